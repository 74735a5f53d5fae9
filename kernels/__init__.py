"""Triton kernels and their pure-PyTorch references; installed as `growtrain.kernels`.

Imports nothing from growtrain (DESIGN.md §2). The folder sits at the repository root, where
`python -m ...` or `python -c ...` puts it on sys.path as a top-level `kernels`: the name of a PyPI
package that bitsandbytes and transformers probe for. Imported under that name, this file hands the
import over to the real package when one is installed. When none is, it leaves behind what a probe
reads as "not installed": a module with no file, no version, no submodules (so the project's kernels
are never executed as a second, top-level copy) and no attributes (`from kernels import x` raises
the very ModuleNotFoundError it raises where no `kernels` exists: bitsandbytes asks that way, and
logs the same line as anywhere else). transformers' probe (find_spec, then importing a package
without metadata) concludes "absent" from exactly that; raising at import instead made its
import, and so `import peft`, fail from the repository root.
"""

if __name__ == "kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _elsewhere = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None:
        _real = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _real  # the import statement returns what sys.modules holds at the end
        _spec.loader.exec_module(_real)
    else:
        __file__ = None
        __path__ = []  # no submodules: `import kernels.grouped` finds nothing
        for _name in ("_machinery", "_util", "_os", "_sys", "_root", "_elsewhere", "_spec"):
            del globals()[_name]
        del _name

        def __getattr__(name: str):
            # Dunders (`__version__`, asked with a default by transformers' probe) are plainly
            # missing; anything else is what importing an absent package gives, so
            # `from kernels import get_kernel` fails exactly as it does where no `kernels` exists.
            if name.startswith("__"):
                raise AttributeError(name)
            raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
