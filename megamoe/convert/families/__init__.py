"""Importing this package registers every family module in it (megamoe.convert.family.FAMILIES)."""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "common":
        importlib.import_module(f"{__name__}.{_module.name}")
