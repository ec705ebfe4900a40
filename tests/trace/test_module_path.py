"""ModulePath: the innermost running module, forward and backward, holding no gradient."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from memplan.trace.core.tracker import ModulePath


class Pair(nn.Module):
    """A module with two inputs that need gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(4, 4)
        self.right = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.left(a) * self.right(b)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.second = nn.Linear(4, 4)
        self.pre = nn.Linear(4, 4)
        self.first = nn.Linear(4, 4)
        self.pair = Pair()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b = self.second(y)  # created first: its backward runs last
        a = self.first(self.pre(x))
        return self.pair(a, b)


def _input_node(addmm: object) -> object:
    """The node that produced a linear layer's input (AddmmBackward's edges: bias, input, weight)."""
    return addmm.next_functions[1][0]  # type: ignore[attr-defined]


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)


def test_paths_forward_and_backward() -> None:
    net = Net()
    seen: list[tuple[str, str]] = []
    with ModulePath() as path:
        def spy(name: str):
            def hook(*_: object) -> None:
                seen.append((name, path()))
            return hook

        net.pair.left.register_forward_pre_hook(spy("left forward"))
        out = net(*_inputs())
        out.grad_fn.register_prehook(spy("pair backward"))  # the product's gradient: inside pair
        a = _input_node(out.grad_fn.next_functions[0][0])  # left's addmm -> a's node (first's addmm)
        a.register_prehook(spy("first backward"))
        assert path() == ""
        out.sum().backward()
        assert path() == ""  # cleared when the backward ends
    assert ("left forward", "pair.left") in seen
    assert ("pair backward", "pair") in seen
    assert ("first backward", "first") in seen


def test_no_input_gradient_is_held_for_the_other_inputs() -> None:
    """``a``'s gradient is consumed by ``first``'s backward long before ``b``'s arrives; a tracker
    that buffers a module's input gradients (ModTracker's all-mode hook) keeps it alive meanwhile."""
    net = Net()
    grad_of_a: list[weakref.ref[torch.Tensor]] = []
    alive_at_pre: list[bool] = []
    with ModulePath():
        out = net(*_inputs())
        left = out.grad_fn.next_functions[0][0]
        first = _input_node(left)
        pre = _input_node(first)
        first.register_prehook(lambda grads: grad_of_a.append(weakref.ref(grads[0])))
        pre.register_prehook(lambda grads: alive_at_pre.append(grad_of_a[0]() is not None))
        out.sum().backward()
    assert alive_at_pre == [False]


def test_exit_removes_the_hooks() -> None:
    net = Net()
    with ModulePath() as path:
        pass
    net(*_inputs())
    assert path() == ""
