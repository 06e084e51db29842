"""megamoe: compose, train, LoRA-tune and convert hybrid-attention sparse MoE multimodal models.

The packages form floors (docs/architecture.md): ``core`` and ``parallel`` below
``megamoe.layers`` / ``megamoe.vision`` / ``data``, below ``model``, ``checkpoint``, ``lora`` /
``convert`` / ``expert_store``, ``training`` / ``inference`` / ``planning`` / ``diagnostics``,
``recipe`` and the ``commands``.
"""
import importlib
import importlib.abc
import importlib.util
import os
import sys
import types
import warnings

__version__ = "0.1.0"

# The repository keeps layers/ and vision/ beside megamoe/; setup.py installs them as
# megamoe.layers and megamoe.vision (package_dir). Installed (wheel, pip --target) they sit
# inside this folder. From a plain checkout on sys.path (PYTHONPATH, `python -m` in the repo
# root, a GPU machine running the checkout beside a --target install) they do not, so this
# finder maps the two names onto the checkout's folders. It goes first on sys.meta_path so a
# checkout never mixes with another copy's layers (an editable install's finder elsewhere).
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
_BESIDE = {f"megamoe.{name}": os.path.join(_ROOT, name) for name in ("layers", "vision")
           if not os.path.isdir(os.path.join(_HERE, name))
           and os.path.isfile(os.path.join(_ROOT, name, "__init__.py"))}


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """megamoe.layers / megamoe.vision from the checkout's top-level folders."""

    def find_spec(self, fullname, path=None, target=None):
        folder = _BESIDE.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


if _BESIDE and not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _CheckoutFinder())


# Public module paths that moved (issue 40): the old name still imports, and its first
# attribute read warns once (DeprecationWarning) and comes from the new module.
MOVED = {
    "megamoe.config": "megamoe.core.config",
    "megamoe.weights": "megamoe.model.weights",
    "megamoe.multimodal": "megamoe.model.multimodal",
    "megamoe.generate": "megamoe.inference.generate",
}


class _MovedModule(types.ModuleType):
    """An old module path whose attributes come from the module's new place."""

    def __getattr__(self, name):
        new = MOVED[self.__name__]
        if not self.__dict__.get("_warned"):
            self._warned = True
            warnings.warn(f"{self.__name__} moved to {new}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)


class _MovedLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return _MovedModule(spec.name)

    def exec_module(self, module):
        pass


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, _MovedLoader()) if fullname in MOVED else None


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())


_MOE_API = ("moe_metrics", "update_expert_bias", "set_aux_loss_scale")


def __getattr__(name):  # lazy, so importing the core does not import megamoe.layers
    if name in _MOE_API:
        from megamoe.model import moe_controls as moe

        return getattr(moe, name)
    raise AttributeError(f"module 'megamoe' has no attribute {name!r}")
