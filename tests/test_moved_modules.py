"""dflash2-hf 0.1's flat module paths keep working, with a FutureWarning naming each module's new home."""

import importlib
import sys

import pytest

from dflash2_hf._moved import MOVED_MODULES


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_forwards_to_the_new_module_and_says_where_it_went(old):
    sys.modules.pop(f"dflash2_hf.{old}", None)
    new = importlib.import_module(f"dflash2_hf.{MOVED_MODULES[old]}")
    with pytest.warns(FutureWarning, match=rf"dflash2_hf\.{old} moved to dflash2_hf\.{MOVED_MODULES[old]}; import"):
        alias = importlib.import_module(f"dflash2_hf.{old}")
    public = [name for name in vars(new) if not name.startswith("_")]
    assert public and all(getattr(alias, name) is getattr(new, name) for name in public)


@pytest.mark.parametrize("statement, name", [
    ("from dflash2_hf.cpu_kernels import PackedLinears, fastest_exact_setting", "fastest_exact_setting"),
    ("from dflash2_hf.block_length import CycleCost", "CycleCost"),
    ("from dflash2_hf.training import DrafterTrainer", "DrafterTrainer"),
    ("from dflash2_hf.drafting import DraftOptions", "DraftOptions"),
    ("from dflash2_hf.drafting import BlockDrafter", "BlockDrafter"),
])
def test_the_imports_users_wrote_for_0_1_still_run(statement, name):
    for old in ("cpu_kernels", "block_length"):
        sys.modules.pop(f"dflash2_hf.{old}", None)
    namespace = {}
    with pytest.warns(FutureWarning, match="moved to"):
        exec(statement, namespace)
    assert callable(namespace[name])


def test_an_unknown_name_on_an_old_path_is_an_import_error():
    with pytest.raises(ImportError, match="no_such_name"), pytest.warns(FutureWarning):
        exec("from dflash2_hf.block_length import no_such_name", {})


@pytest.mark.parametrize("wing", ["training", "drafting"])
def test_a_wing_named_like_an_old_module_refuses_names_neither_had(wing):
    module = importlib.import_module(f"dflash2_hf.{wing}")
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name


def test_a_wing_named_like_an_old_module_still_imports_its_own_submodules_silently(recwarn):
    from dflash2_hf.drafting import lookup
    from dflash2_hf.training import data

    assert lookup.__name__ == "dflash2_hf.drafting.lookup" and data.__name__ == "dflash2_hf.training.data"
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_a_star_import_from_an_old_path_imports_what_one_from_the_new_path_does(old):
    sys.modules.pop(f"dflash2_hf.{old}", None)
    through_old, through_new = {}, {}
    exec(f"from dflash2_hf.{MOVED_MODULES[old]} import *", through_new)
    with pytest.warns(FutureWarning, match="moved to"):
        exec(f"from dflash2_hf.{old} import *", through_old)
    for namespace in (through_old, through_new):
        namespace.pop("__builtins__"), namespace.pop("__warningregistry__", None)
    assert through_old and through_old.keys() == through_new.keys()
    assert all(through_old[name] is through_new[name] for name in through_new)
