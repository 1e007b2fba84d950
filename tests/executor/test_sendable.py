"""What a request may carry to tensor-parallel ranks in other processes (executor/base.check_sendable_to_ranks)."""

from __future__ import annotations

import sys
import types

import pytest

from vllm_spec.executor.base import check_sendable_to_ranks


def test_objects_the_ranks_could_not_unpickle_are_refused(monkeypatch):
    main = types.ModuleType("__main__")   # as under python -c, a REPL or a notebook: no file to import again
    tag = type("Tag", (), {"__module__": "__main__"})
    main.Tag = tag
    monkeypatch.setitem(sys.modules, "__main__", main)
    with pytest.raises(ValueError, match=r"extra_args holds .*Tag.*defined in __main__"):
        check_sendable_to_ranks({"tags": [tag()]}, "extra_args")
    main.__file__ = "/srv/app/serve.py"   # a script: each spawned rank imports it again, Tag with it
    check_sendable_to_ranks({"tags": [tag()]}, "extra_args")
    with pytest.raises(ValueError, match="extra_args must be picklable with tensor_parallel_size > 1"):
        check_sendable_to_ranks({"callback": lambda x: x}, "extra_args")
    check_sendable_to_ranks({"note": "__main__", "n": [1, 2.5, None]}, "extra_args")
