"""Diagnosis: what makes a loop slow or wrong on a TPU, found in three places from one table.

* ``rules.py``: the pitfalls (what each costs, the fix, the API it replaces).
* ``doctor.py``: runs your step and names the pitfalls it hits (run time).
* ``check.py``: runs the package's guarantees on this machine (the platform).
* ``port.py``: rewrites a script or notebook for today's torch_xla and lists what it left (the source).
"""

from .doctor import DoctorError, DoctorReport, Finding, doctor
from .rules import RULES, Rule

__all__ = ["doctor", "DoctorError", "DoctorReport", "Finding", "Rule", "RULES"]
