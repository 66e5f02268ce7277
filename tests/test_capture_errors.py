"""Models capture cannot follow get a CaptureError that names the module path,
the op and the source line, and says what to do; never a raw torch error."""
import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import CaptureError


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # Python branch on a tensor value
            return y * 2
        return y


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = Router()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(self.router(x))


class Stack(nn.Module):
    def __init__(self, block=Block, n=4):
        super().__init__()
        self.blocks = nn.ModuleList([block() for _ in range(n)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_data_dependent_control_flow_names_module_op_and_line():
    with pytest.raises(CaptureError) as info:
        autopar.capture(Stack(), (torch.randn(2, 4, 8),))
    err = info.value
    assert "module blocks.0.router" in err.message
    assert "data-dependent control flow" in err.message
    assert "_local_scalar_dense" in err.message
    assert "test_capture_errors.py" in err.message and "if y.sum() > 0" in err.message
    assert "torch.where" in err.hint
    assert err.__cause__ is None  # no chained torch traceback


class ItemBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        steps = int(self.fc(x).argmax().item())  # a value read back into Python
        return self.fc(x) * steps


def test_item_is_reported_as_data_dependent():
    with pytest.raises(CaptureError, match=r"module blocks.0: data-dependent"):
        autopar.capture(Stack(ItemBlock, 2), (torch.randn(2, 8),))


class MaskSelect(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return y[y > 0].sum()  # data-dependent output size


def test_boolean_mask_indexing_outside_moe_routing_is_explained():
    with pytest.raises(CaptureError) as info:
        autopar.capture(MaskSelect(), (torch.randn(2, 8),))
    assert "data-dependent output size" in info.value.message
    assert "y[y > 0]" in info.value.message
    assert "torch.where" in info.value.hint


@torch.library.custom_op("autopar_test::cpu_only", mutates_args=())
def cpu_only(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


class UsesCustomOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return cpu_only(self.proj(x))


def test_op_without_meta_kernel_names_op_and_suggests_register_fake():
    model = nn.Sequential(nn.Linear(8, 8), UsesCustomOp())
    with pytest.raises(CaptureError) as info:
        autopar.capture(model, (torch.randn(2, 8),))
    err = info.value
    assert "module 1" in err.message and "autopar_test.cpu_only" in err.message
    assert "register_fake" in err.hint


def test_bad_inputs_and_bad_model_are_capture_errors():
    with pytest.raises(CaptureError, match="tuple of tensors"):
        autopar.capture(Stack(), "not inputs")
    with pytest.raises(CaptureError, match="nn.Module"):
        autopar.capture(lambda x: x, (torch.randn(2, 8),))
    with pytest.raises(CaptureError, match=r"module blocks.0.router.lin: op aten.*same reduction dim"):
        autopar.capture(Stack(), (torch.randn(2, 4, 9),))  # wrong feature size
    with pytest.raises(CaptureError, match="example_inputs.*raised ValueError"):
        autopar.capture(Stack(), lambda b: (_ for _ in ()).throw(ValueError("boom")))


def test_cli_prints_capture_errors_without_traceback(tmp_path, capsys):
    from autopar.cli import main

    path = tmp_path / "branchy.py"
    path.write_text(
        "import torch, torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.fc = nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x) if x.mean() > 0 else x\n"
        "def build_model(): return M()\n"
        "def example_inputs(batch_size): return (torch.randn(batch_size, 4),)\n")
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert "data-dependent control flow" in err and "branchy.py:6" in err and "Traceback" not in err
