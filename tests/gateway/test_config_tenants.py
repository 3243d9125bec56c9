"""Gateway configuration and tenants: flags, TOML, salts, authentication."""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from kvreuse.errors import ConfigError
from kvreuse.gateway.config import load_config_file, merge, parse_upstream_flag
from kvreuse.gateway.tenants import load_tenants
from kvreuse.gateway.validation import check_cache_salt


def test_upstream_flag_parses_its_options() -> None:
    """URL,key=value pairs fill the upstream; the name defaults to the URL."""
    upstream = parse_upstream_flag(
        "http://127.0.0.1:8001,events=tcp://127.0.0.1:5557,bind=false,weight=2,topic=kv")
    assert upstream.name == "http://127.0.0.1:8001" and upstream.weight == 2.0
    assert upstream.events == "tcp://127.0.0.1:5557" and upstream.bind is False


def test_backup_is_a_flag_option_and_a_toml_key(tmp_path: Path) -> None:
    """backup=true on --upstream and backup = true in [[upstreams]] mark a backup; off by
    default; a value that is no boolean is refused naming the key."""
    assert parse_upstream_flag("http://h:1,backup=true").backup is True
    assert parse_upstream_flag("http://h:1").backup is False
    path = tmp_path / "gateway.toml"
    path.write_text('[[upstreams]]\nurl = "http://h:1"\nbackup = true\n')
    assert load_config_file(path).upstreams[0].backup is True
    with pytest.raises(ConfigError, match="backup"):
        parse_upstream_flag("http://h:1,backup=maybe")


@pytest.mark.parametrize(
    ("flag", "needle"),
    [("ftp://x", "http"), ("http://h:1,weight=0", "weight"), ("http://h:1,color=red", "color"),
     ("http://h:1,events=5557", "ZeroMQ endpoint"), ("http://h:1,weight", "key=value"),
     ("http://h:99999", "HOST:PORT"), ("http://h:abc", "HOST:PORT"), ("http://:8000", "HOST:PORT"),
     ("http://[::1:8000", "HOST:PORT"), ("http://h x:8000", "HOST:PORT"),
     ("http://h:1,weight=nan", "finite"), ("http://h:1,weight=inf", "finite"),
     ("http://h:1,events=http://h:5557", "ZeroMQ endpoint"),
     ("http://h:1,events=tcp://h", "ZeroMQ endpoint"),
     ("http://h:1,events=tcp://h:70000", "ZeroMQ endpoint"),
     ("http://h:1,events=tcp://*:5557,bind=false", "engine's address"),
     ("http://h:1,events=tcp://h:5557,replay=tcp://*:5558", "engine's address")],
)
def test_bad_upstream_flags_name_the_problem(flag: str, needle: str) -> None:
    """Each bad flag is refused naming what to change."""
    with pytest.raises(ConfigError, match=needle):
        parse_upstream_flag(flag)


def test_toml_file_and_flags_merge(tmp_path: Path) -> None:
    """A file's upstreams and options load; flags add upstreams and override options."""
    path = tmp_path / "gw.toml"
    path.write_text(
        '[gateway]\npolicy = "prefix_hash"\nretries = 1\n'
        '[gateway.policy_options]\noverload = 1.5\n'
        '[[upstreams]]\nurl = "http://127.0.0.1:8001"\nname = "a"\n'
    )
    config = merge(load_config_file(path), [parse_upstream_flag("http://127.0.0.1:8002")],
                   retries=3)
    assert [u.name for u in config.upstreams] == ["a", "http://127.0.0.1:8002"]
    assert config.policy == "prefix_hash" and config.retries == 3
    assert config.policy_options == {"overload": 1.5}


def test_toml_errors_name_the_key(tmp_path: Path) -> None:
    """Unknown keys and duplicate names are refused by name."""
    path = tmp_path / "gw.toml"
    path.write_text('[gateway]\npolcy = "x"\n[[upstreams]]\nurl = "http://h:1"\n')
    with pytest.raises(ConfigError, match="polcy"):
        load_config_file(path)
    with pytest.raises(ConfigError, match="unique"):
        merge(None, [parse_upstream_flag("http://h:1"), parse_upstream_flag("http://h:1")])


@pytest.mark.parametrize(
    ("keys", "needle"),
    [('"" = "acme"', "API key 2 of [keys] cannot be sent"),
     ('" sk-c" = "acme"', "API key 2 of [keys] cannot be sent"),
     ('"sk-c\\n" = "acme"', "API key 2 of [keys] cannot be sent"),
     ('"sk-c" = ""', "the tenant of API key 2"),
     ('"sk-c" = "ac\\u0000me"', "the tenant of API key 2"),
     (f'"sk-c" = "{"t" * 257}"', "1 to 256 printable characters"),
     ('"sk-c" = 5', "the tenant of API key 2")],
)
def test_keys_no_client_can_send_and_unprintable_tenants_are_refused(
    tmp_path: Path, keys: str, needle: str,
) -> None:
    """A key that can never match, or a tenant name unfit for logs, is refused by its place in
    [keys], without echoing the key."""
    path = tmp_path / "tenants.toml"
    path.write_text('secret = "0123456789abcdef-secret"\n[keys]\n"sk-a" = "acme"\n' + keys + "\n")
    with pytest.raises(ConfigError, match=re.escape(needle)) as refused:
        load_tenants(path)
    assert "sk-c" not in str(refused.value)


def test_a_tenants_file_not_in_utf8_is_refused_by_name(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 are a ConfigError naming the file, not a traceback."""
    path = tmp_path / "tenants.toml"
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not valid UTF-8"):
        load_tenants(path)


def test_a_config_file_not_in_utf8_is_refused_by_name(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 are a ConfigError naming the file, not a traceback."""
    path = tmp_path / "gw.toml"
    path.write_bytes(b"\xff\xfe[gateway]\n")
    with pytest.raises(ConfigError, match=r"gw\.toml: not valid UTF-8 \(byte 0\)"):
        load_config_file(path)


@pytest.mark.parametrize("load", [load_config_file, load_tenants],
                         ids=["config", "tenants"])
def test_a_toml_file_nested_too_deeply_is_refused_by_name(
    tmp_path: Path, load: Callable[[Path], object]
) -> None:
    """5,000 nested arrays (tomllib recurses once per level) are a ConfigError naming the
    file, not a RecursionError: at start, and at a SIGHUP's re-read of --config."""
    path = tmp_path / "deep.toml"
    path.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"deep\.toml: not valid TOML: nested too deeply"):
        load(path)


def test_endpoints_the_gateway_binds_may_use_any_interface() -> None:
    """tcp://*:PORT is fine where the gateway binds (the default), and ipc:// either way."""
    assert parse_upstream_flag("http://h:1,events=tcp://*:5557").events == "tcp://*:5557"
    assert parse_upstream_flag("http://h:1,events=ipc:///tmp/kv,bind=false").bind is False


def tenants_file(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(
        'secret = "0123456789abcdef-secret"\n' + extra +
        '[keys]\n"sk-a" = "acme"\n"sk-b" = "globex"\n'
        '[tenants.globex]\nupstreams = ["r1"]\n'
    )
    return path


def test_salt_is_hmac_sha256_of_the_tenant(tmp_path: Path) -> None:
    """The salt is HMAC-SHA256(secret, tenant) in hex, inside vLLM's salt rules."""
    tenants = load_tenants(tenants_file(tmp_path))
    tenant = tenants.authenticate("Bearer sk-a")
    assert tenant is not None and tenant.name == "acme"
    expected = hmac.new(b"0123456789abcdef-secret", b"acme", hashlib.sha256).hexdigest()
    assert tenant.cache_salt == expected and check_cache_salt(tenant.cache_salt) == expected
    other = tenants.authenticate("bearer sk-b")
    assert other is not None and other.cache_salt != expected and other.upstreams == ("r1",)


def test_unknown_or_missing_keys_authenticate_to_nobody(tmp_path: Path) -> None:
    """Unknown keys, other schemes and missing headers give no tenant."""
    tenants = load_tenants(tenants_file(tmp_path))
    for header in (None, "", "Bearer sk-zzz", "Basic sk-a", "Bearer "):
        assert tenants.authenticate(header) is None


def test_secret_from_the_environment(tmp_path: Path) -> None:
    """secret_env reads the secret from the environment; a missing variable is an error."""
    path = tmp_path / "t.toml"
    path.write_text('secret_env = "GW_SECRET"\n[keys]\n"k" = "t"\n')
    assert load_tenants(path, {"GW_SECRET": "x" * 20}).secret == b"x" * 20
    with pytest.raises(ConfigError, match="GW_SECRET"):
        load_tenants(path, {})


def test_weak_secret_is_refused(tmp_path: Path) -> None:
    """A short secret would make salts guessable."""
    path = tmp_path / "t.toml"
    path.write_text('secret = "short"\n[keys]\n"k" = "t"\n')
    with pytest.raises(ConfigError, match="16 characters"):
        load_tenants(path)


def test_tenant_subset_must_name_real_upstreams(tmp_path: Path) -> None:
    """A tenant pinned to an upstream the gateway does not have is a startup error."""
    from kvreuse.gateway.app import Gateway
    from kvreuse.gateway.config import GatewayConfig

    config = GatewayConfig(upstreams=(parse_upstream_flag("http://127.0.0.1:1,name=r0"),),
                           tenants=str(tenants_file(tmp_path)))
    with pytest.raises(ConfigError, match="r1"):
        Gateway(config)


def test_models_are_declared_by_flag_and_by_toml(tmp_path: Path) -> None:
    """models=a|b on a flag and models = [...] in TOML declare the served names."""
    assert parse_upstream_flag("http://h:1,models=llama-8b|llama-8b-chat").models == (
        "llama-8b", "llama-8b-chat")
    path = tmp_path / "gw.toml"
    path.write_text('[[upstreams]]\nurl = "http://h:1"\nmodels = ["a", "b"]\n'
                    '[[upstreams]]\nurl = "http://h:2"\n')
    assert [u.models for u in load_config_file(path).upstreams] == [("a", "b"), ()]


@pytest.mark.parametrize(
    ("flag", "needle"),
    [("http://h:1,models=", "at least one"), ("http://h:1,models=a||b", "at least one"),
     ("http://h:1,models=a|a", "twice"), ("http://h:1,models=" + "m" * 600, "at most 512")],
)
def test_bad_model_declarations_name_the_problem(flag: str, needle: str) -> None:
    """Empty names, duplicates and absurd names are refused by what to change."""
    with pytest.raises(ConfigError, match=needle):
        parse_upstream_flag(flag)


def test_toml_models_must_be_strings(tmp_path: Path) -> None:
    """A TOML models array of anything but strings is refused, naming the upstream."""
    path = tmp_path / "gw.toml"
    path.write_text('[[upstreams]]\nurl = "http://h:1"\nmodels = [1, 2]\n')
    with pytest.raises(ConfigError, match=r"upstreams\[0\]: models must be"):
        load_config_file(path)


def test_access_log_and_metrics_port_from_the_file_and_flags(tmp_path: Path) -> None:
    """access_log and metrics_port load from [gateway]; flags override; bad values are refused
    by name."""
    path = tmp_path / "gw.toml"
    path.write_text('[gateway]\naccess_log = "text"\nmetrics_port = 9464\n'
                    '[[upstreams]]\nurl = "http://127.0.0.1:8001"\n')
    config = load_config_file(path)
    assert config.access_log == "text" and config.metrics_port == 9464
    assert merge(config, [], access_log="json").access_log == "json"
    for bad, needle in (('access_log = "yes"', "access_log"), ("metrics_port = 0", "metrics_port"),
                        ('metrics_port = "9464"', "metrics_port"),
                        ("metrics_port = true", "metrics_port")):
        path.write_text(f'[gateway]\n{bad}\n[[upstreams]]\nurl = "http://127.0.0.1:8001"\n')
        with pytest.raises(ConfigError, match=needle):
            load_config_file(path)


def test_prefill_speed_settings_from_the_file_and_flags(tmp_path: Path) -> None:
    """prefill_tokens_per_s, prefill_overhead_s and learn_prefill load from [gateway]; flags
    override; nonsense is refused by name."""
    path = tmp_path / "gw.toml"
    path.write_text('[gateway]\nprefill_tokens_per_s = 2500.0\nprefill_overhead_s = 0.04\n'
                    'learn_prefill = false\n[[upstreams]]\nurl = "http://127.0.0.1:8001"\n')
    config = load_config_file(path)
    assert (config.prefill_tokens_per_s, config.prefill_overhead_s) == (2500.0, 0.04)
    assert config.learn_prefill is False
    assert merge(config, [], learn_prefill=True).learn_prefill is True
    for bad, needle in (("prefill_tokens_per_s = 0", "prefill_tokens_per_s"),
                        ("prefill_tokens_per_s = -5.0", "prefill_tokens_per_s"),
                        ("prefill_tokens_per_s = inf", "prefill_tokens_per_s"),
                        ("prefill_tokens_per_s = nan", "prefill_tokens_per_s"),
                        ('prefill_tokens_per_s = "fast"', "prefill_tokens_per_s"),
                        ("prefill_overhead_s = -0.1", "prefill_overhead_s"),
                        ("prefill_overhead_s = 61", "prefill_overhead_s"),
                        ('learn_prefill = "yes"', "learn_prefill")):
        path.write_text(f'[gateway]\n{bad}\n[[upstreams]]\nurl = "http://127.0.0.1:8001"\n')
        with pytest.raises(ConfigError, match=needle):
            load_config_file(path)


def test_keys_match_as_utf8_bytes_in_constant_time(tmp_path: Path) -> None:
    """A non-ASCII key matches its UTF-8 bytes (bytes or str header), never its latin-1
    bytes; an oversized or non-Bearer value matches nothing."""
    path = tmp_path / "tenants.toml"
    path.write_text('secret = "a-long-enough-secret"\n[keys]\n"sk-café" = "acme"\n',
                    encoding="utf-8")
    tenants = load_tenants(path)
    assert tenants.authenticate("Bearer sk-café") is not None
    assert tenants.authenticate("Bearer sk-café".encode()) is not None
    assert tenants.authenticate("Bearer sk-café".encode("latin-1")) is None
    assert tenants.authenticate(b"Bearer " + b"k" * 1_000_000) is None
    assert tenants.authenticate(b"Basic sk-caf\xc3\xa9") is None
    assert tenants.authenticate(b"Bearer ") is None
