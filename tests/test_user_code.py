"""`import_user_object`: what a config's 'package.module:function' names."""

from __future__ import annotations

import pytest

from tandem.launch.rpc import WorkerGroup
from tandem.train.losses import sft_loss
from tandem.user_code import import_user_object


def test_import_user_object():
    assert import_user_object("tandem.train:sft_loss") is sft_loss
    assert import_user_object("tandem.train.losses:sft_loss") is sft_loss
    assert import_user_object("tandem.launch.rpc:WorkerGroup.call") is WorkerGroup.call
    for bad in ("tandem.train.sft_loss", ":sft_loss", "tandem.train:"):
        with pytest.raises(ValueError, match=r"package\.module:function"):
            import_user_object(bad)
    with pytest.raises(ModuleNotFoundError):
        import_user_object("tandem.no_such_module:f")
    with pytest.raises(AttributeError):
        import_user_object("tandem.train.losses:no_such_function")
