"""What a snapshot's stack frames say: site, module and category of one allocation."""

from __future__ import annotations

from memplan.diff.frames import OUTSIDE, UNKNOWN, frame_keys


def _py(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


def _cpp(name: str) -> dict:
    return {"filename": "??", "line": 0, "name": name}


def test_the_site_skips_the_allocator_pytorch_and_the_standard_library() -> None:
    frames = [
        _cpp("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(signed char, unsigned long)"),
        _cpp("at::_ops::mm::call(at::Tensor const&, at::Tensor const&)"),
        _py("/opt/pytorch/torch/nn/modules/linear.py", 125, "forward"),
        _py(r"C:\Python311\Lib\contextlib.py", 81, "inner"),
        _py("/venv/lib/python3.12/site-packages/transformers/models/llama/modeling_llama.py", 180, "forward"),
        _py("/venv/lib/python3.12/site-packages/torch/nn/modules/module.py", 1790, "_call_impl"),
        _py("/home/u/train.py", 40, "forward"),
        _py("/home/u/train.py", 90, "main"),
    ]
    category, module, site = frame_keys(frames)
    assert site == "llama/modeling_llama.py:180 forward"  # an installed library's model code is a site
    assert module == "u/train.py:40 > llama/modeling_llama.py forward"
    assert category == UNKNOWN


def test_the_autograd_thread_names_its_node_and_workspaces_are_recognised() -> None:
    backward = [_cpp("at::_ops::bmm::call(at::Tensor const&, at::Tensor const&)"),
                _cpp("torch::autograd::generated::BmmBackward0::apply(std::vector<at::Tensor>&&)"),
                _cpp("torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)")]
    assert frame_keys(backward) == (UNKNOWN, OUTSIDE, "autograd BmmBackward0")
    workspace = [_cpp("at::cuda::getNewWorkspace()"), *backward]
    assert frame_keys(workspace)[0] == "workspace"
    grads = [_cpp("torch::autograd::AccumulateGrad::apply(std::vector<at::Tensor>&&)")]
    assert frame_keys(grads) == ("gradient", OUTSIDE, "autograd AccumulateGrad")
    state = [_py("/venv/lib/python3.11/site-packages/torch/optim/adam.py", 160, "_init_group"),
             _py("/home/u/train.py", 12, "step")]
    assert frame_keys(state) == ("optimizer_state", OUTSIDE, "u/train.py:12 step")


def test_no_frames_is_unknown() -> None:
    assert frame_keys([])[2].startswith(UNKNOWN) and frame_keys(None)[0] == UNKNOWN
