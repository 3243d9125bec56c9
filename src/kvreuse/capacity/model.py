"""KV bytes per token from a Hugging Face ``config.json``, and a replica's idle cache budget.

Seed 000: an 8B model with grouped-query attention keeps ``2 x 32 layers x 8 KV heads x 128 dims
x 2 bytes = 128 KiB`` per token. Seed 001: a cached prefix "is just a set of blocks that have not
been reclaimed yet": the cache gets what the running batch leaves of the KV pool.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvreuse.errors import ConfigError, InputFormatError

GIB = 1024**3
MIB = 1024**2
KIB = 1024

DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "int8": 1,
    "int4": 0.5,
}
"""Bytes per element for dtype names in configs and ``--kv-cache-dtype`` values."""


def dtype_bytes(name: str, what: str = "dtype") -> float:
    try:
        return DTYPE_BYTES[name.lower().removeprefix("torch.")]
    except KeyError:
        raise ConfigError(f"unknown {what} {name!r}; use one of {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one token's keys and values occupy. ``latent_dim`` is set for MLA models (DeepSeek),
    which cache one compressed latent per layer instead of per-head keys and values."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: float
    latent_dim: int | None = None

    @property
    def bytes_per_token(self) -> int:
        if self.latent_dim is not None:
            return int(self.layers * self.latent_dim * self.dtype_bytes)
        return int(2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes)

    def describe(self) -> str:
        if self.latent_dim is not None:
            return (
                f"{self.layers} layers x {self.latent_dim} latent dims x {self.dtype_bytes:g} "
                "bytes (MLA)"
            )
        return (
            f"2 x {self.layers} layers x {self.kv_heads} KV heads x {self.head_dim} dims x "
            f"{self.dtype_bytes:g} bytes"
        )


MAX_CONFIG_DIMENSION = 2**20
"""Largest layer count, head count or dimension a config.json may give: far past any model's
(so a typo, not a model), and small enough that KV bytes per token stay exact arithmetic."""


def _int(config: Mapping[str, Any], key: str, where: str, minimum: int = 1) -> int:
    value = config.get(key)
    if (not isinstance(value, int) or isinstance(value, bool)
            or not minimum <= value <= MAX_CONFIG_DIMENSION):
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise InputFormatError(f"needs {kind} {key!r} (at most {MAX_CONFIG_DIMENSION:,}), got "
                               f"{value!r:.40}", where=where)
    return value


def kv_shape_from_config(
    config: Mapping[str, Any], kv_cache_dtype: str | None = None, where: str = "config.json"
) -> KVShape:
    """Read layers, KV heads, head dim and dtype; ``kv_cache_dtype`` (e.g. ``fp8``) overrides
    the model dtype as vLLM's ``--kv-cache-dtype`` does. Multimodal configs use their
    ``text_config``."""
    text_config = config.get("text_config")
    if isinstance(text_config, Mapping) and "num_hidden_layers" in text_config:
        merged = {**config, **text_config}
        config = merged
    layers = _int(config, "num_hidden_layers", where)
    if kv_cache_dtype:
        element = dtype_bytes(kv_cache_dtype, "--kv-cache-dtype")
    else:
        # The first of the keys that is set; null is unset, but 0, "" or [] is a malformed
        # file, not a reason to assume bfloat16.
        dtype_key = next((key for key in ("torch_dtype", "dtype")
                          if config.get(key) is not None), None)
        dtype_name = "bfloat16" if dtype_key is None else config[dtype_key]
        if not isinstance(dtype_name, str) or not dtype_name:
            raise InputFormatError(f"'{dtype_key}' must be a dtype name such as \"bfloat16\", "
                                   f"got {dtype_name!r}", where=where)
        element = dtype_bytes(dtype_name, dtype_key or "torch_dtype")
    if config.get("kv_lora_rank") is not None:
        rope = 0 if config.get("qk_rope_head_dim") is None else _int(
            config, "qk_rope_head_dim", where, minimum=0)
        latent = _int(config, "kv_lora_rank", where) + rope
        return KVShape(layers, 1, latent, element, latent_dim=latent)
    heads = _int(config, "num_attention_heads", where)
    # Absent or null means one KV head per attention head (HF's convention); 0 is a mistake.
    kv_heads = heads if config.get("num_key_value_heads") is None else _int(
        config, "num_key_value_heads", where)
    if config.get("head_dim") is None:
        head_dim = _int(config, "hidden_size", where) // heads
        if head_dim < 1:
            raise InputFormatError(f"'hidden_size' {config['hidden_size']} is smaller than "
                                   f"'num_attention_heads' {heads}", where=where)
    else:
        head_dim = _int(config, "head_dim", where)
    return KVShape(layers, kv_heads, head_dim, element)


@dataclass(frozen=True, slots=True)
class CacheBudget:
    """One replica's KV memory: the pool, what running requests pin, and the idle rest that
    cached prefixes can use (it shrinks exactly when traffic peaks)."""

    pool_bytes: float
    pinned_bytes: float
    derivation: str

    @property
    def idle_bytes(self) -> float:
        return max(0.0, self.pool_bytes - self.pinned_bytes)


def cache_budget(
    *,
    bytes_per_token: int,
    kv_pool_gib: float | None = None,
    gpu_memory_gib: float | None = None,
    gpus: int = 1,
    utilisation: float = 0.9,
    weights_gib: float | None = None,
    overhead_gib: float = 0.0,
    pinned_gib: float | None = None,
    running_requests: int = 0,
    running_tokens: int = 0,
) -> CacheBudget:
    """The idle cache budget of one replica.

    The pool is given (``kv_pool_gib``) or derived as vLLM sizes it: ``gpus x memory x
    utilisation - weights - overhead`` (activations, CUDA graphs). The pin is given
    (``pinned_gib``) or ``running_requests x running_tokens x bytes_per_token``.
    """
    if kv_pool_gib is not None:
        pool = kv_pool_gib * GIB
        how = f"KV pool {kv_pool_gib:g} GiB (given)"
    else:
        if gpu_memory_gib is None or weights_gib is None:
            raise ConfigError(
                "give --kv-pool-gib, or --gpu-memory-gib with --weights-gib (or --params-b)"
            )
        if not 0 < utilisation <= 1:
            raise ConfigError(f"--utilisation must be in (0, 1], got {utilisation}")
        pool = (gpus * gpu_memory_gib * utilisation - weights_gib - overhead_gib) * GIB
        how = (
            f"KV pool = {gpus} x {gpu_memory_gib:g} GiB x {utilisation:g} - {weights_gib:g} GiB "
            f"weights - {overhead_gib:g} GiB overhead = {pool / GIB:.1f} GiB"
        )
        if pool <= 0:
            raise ConfigError(f"no memory left for KV cache: {how}")
    if pinned_gib is not None:
        pinned = pinned_gib * GIB
        how += f"; running requests pin {pinned_gib:g} GiB (given)"
    else:
        pinned = float(running_requests * running_tokens * bytes_per_token)
        how += (
            f"; {running_requests} running requests x {running_tokens:,} tokens pin "
            f"{pinned / GIB:.1f} GiB"
        )
    return CacheBudget(pool, pinned, how)
