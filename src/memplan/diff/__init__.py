"""``memplan diff``: the peak difference between two memory snapshots or traces, attributed.

::

    from memplan.diff import diff_files

    result = diff_files("before.pickle", "after.pickle")     # or two memplan traces, or one of each
    result.peak_delta_bytes                                  # peak(B) - peak(A), requested bytes
    result.categories, result.modules, result.sites          # each adds up to peak_delta_bytes
    result.to_dict()                                         # the JSON of memplan diff --json

See :mod:`memplan.diff.compare` for what is compared and its limitations, and
:mod:`memplan.diff.frames` for what a snapshot's stack frames can tell.
"""

from memplan.diff.compare import Delta, DiffResult, check_comparable, diff_profiles
from memplan.diff.files import diff_files, load_profile
from memplan.diff.profile import Profile

__all__ = [
    "Delta", "DiffResult", "Profile", "check_comparable", "diff_files", "diff_profiles", "load_profile",
]
