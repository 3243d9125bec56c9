"""``kvreuse lab``: a local web page that runs the fleet simulator and animates the result.

:mod:`kvreuse.web.app` serves the page (``static/``, shipped as package data) and its JSON API;
:mod:`kvreuse.web.adapter` is the only module that calls the simulator;
:func:`kvreuse.web.links.lab_url` builds a link that opens a given run in the lab.
"""

from kvreuse.web.controls import LabControls
from kvreuse.web.links import lab_query, lab_url

__all__ = ["LabControls", "lab_query", "lab_url"]
