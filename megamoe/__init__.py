"""megamoe: compose, train, LoRA-tune and convert hybrid-attention sparse MoE multimodal models.

The core (config, layout, spec, parallel) does not import ``megamoe.layers`` or
``megamoe.vision``; ``megamoe.model`` is where they meet.
"""
import importlib.abc
import importlib.util
import os
import sys

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


_MOE_API = ("moe_metrics", "update_expert_bias", "set_aux_loss_scale")


def __getattr__(name):  # lazy, so importing the core does not import megamoe.layers
    if name in _MOE_API:
        from megamoe import moe

        return getattr(moe, name)
    raise AttributeError(f"module 'megamoe' has no attribute {name!r}")
