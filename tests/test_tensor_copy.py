import pytest
import torch

from tandem.tensor_copy import copy_all


def test_copy_all_casts_into_views_and_checks_its_arguments():
    srcs = [torch.randn(3, 4), torch.randn(5), torch.empty(0, 2)]
    buf = torch.zeros(32, dtype=torch.bfloat16)
    dsts = [buf[:12].view(3, 4), buf[16:21], buf[24:24].view(0, 2)]
    copy_all(dsts, srcs)
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d, s.to(torch.bfloat16))
    assert torch.count_nonzero(buf[12:16]) == 0 and torch.count_nonzero(buf[21:]) == 0  # nothing else written
    copy_all([], [])  # nothing to do
    with pytest.raises(ValueError, match="as many destinations as sources"):
        copy_all(dsts, srcs[:2])
