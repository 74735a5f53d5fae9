"""Triton kernels and their pure-PyTorch references; installed as `growtrain.kernels`.

Imports nothing from growtrain (DESIGN.md §2). The folder sits at the repository root, where
`python -m ...` or `python -c ...` puts it on sys.path as a top-level `kernels`: the name of a PyPI
package that bitsandbytes imports at start-up. Imported under that name, this file hands the import
over to the real package (or fails as if this folder were not there), so the project's kernels are
never executed as a second, top-level copy.
"""

if __name__ == "kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _elsewhere = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None:
        del _sys.modules["kernels"]
        raise ModuleNotFoundError("No module named 'kernels' (the repository's kernels/ folder is growtrain.kernels)", name="kernels")
    _real = _util.module_from_spec(_spec)
    _sys.modules["kernels"] = _real  # the import statement returns what sys.modules holds at the end
    _spec.loader.exec_module(_real)
