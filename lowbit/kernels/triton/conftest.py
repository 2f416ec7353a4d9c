"""pytest (doctest collection): these modules import triton, an optional dependency;
without it they are not collected."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("triton") else ["*.py"]
