"""gpu/df11_compat.py on the CPU: what DFloat11 0.5.0 imports, provided on transformers 5.

The shim always: ``transformers.modeling_utils.no_init_weights`` is transformers 5's
context manager (init functions do nothing inside it) and ``pkg_resources`` finds package
files where setuptools no longer ships it. Where the ``dfloat11`` and ``dahuffman``
packages are installed (the GPU machine's wheels, so that test carries the ``cuda`` marker
and runs there: ``python3 -m pytest -m cuda tests/test_df11_compat.py``), DFloat11's
own ``compress_model`` codes a tiny Llama on the CPU and ``DFloat11Model.from_pretrained``
loads it through the shim: every coded weight replaced by DFloat11's buffers and its
decode hook, the rest of the model the original's. The decode kernel itself needs a GPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_GPU = Path(__file__).resolve().parents[1] / "gpu"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, _GPU / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_install_provides_what_dfloat11_imports(monkeypatch) -> None:
    import transformers.modeling_utils as mu

    compat = _module("df11_compat")
    monkeypatch.setattr(mu, "no_init_weights", None, raising=False)
    monkeypatch.delattr(mu, "no_init_weights")  # as on transformers 5
    monkeypatch.setitem(sys.modules, "pkg_resources", None)  # as on setuptools >= 81
    with pytest.raises(ImportError):
        from transformers.modeling_utils import no_init_weights  # noqa: F401
    compat.install()
    from transformers.modeling_utils import no_init_weights

    w = torch.zeros(4, 4)
    with no_init_weights():
        torch.nn.init.normal_(w)
    assert torch.equal(w, torch.zeros(4, 4))  # nothing initialized inside
    torch.nn.init.normal_(w)
    assert not torch.equal(w, torch.zeros(4, 4))  # and restored after
    import pkg_resources

    found = Path(pkg_resources.resource_filename("entropykit", "__init__.py"))
    assert found.is_file() and found.parent.name == "entropykit"
    compat.install()  # twice: nothing changes
    from transformers.modeling_utils import no_init_weights as again

    assert again is no_init_weights


def _cupy_stub() -> types.ModuleType:
    """CuPy as far as importing dfloat11 goes: its kernel loads, and fails if called."""

    class RawModule:
        def __init__(self, path: str) -> None:
            assert Path(path).is_file(), path  # the wheel's decode.ptx, found

        def get_function(self, name: str):
            def kernel(*args, **kwargs):
                raise RuntimeError("no GPU here")

            return kernel

    cuda = types.SimpleNamespace(Device=lambda index: contextlib.nullcontext())
    return types.SimpleNamespace(RawModule=RawModule, cuda=cuda)


@pytest.mark.cuda
def test_dfloat11_model_loads_through_the_shim(tmp_path, monkeypatch) -> None:
    pytest.importorskip("dahuffman")
    if importlib.util.find_spec("dfloat11") is None:
        pytest.skip("dfloat11 is not installed")
    import transformers.modeling_utils as mu

    compat = _module("df11_compat")
    monkeypatch.setattr(mu, "no_init_weights", None, raising=False)
    monkeypatch.delattr(mu, "no_init_weights")
    if importlib.util.find_spec("cupy") is None:
        monkeypatch.setitem(sys.modules, "cupy", _cupy_stub())
    # what install() adds to sys.modules goes again after the test
    monkeypatch.setitem(sys.modules, "pkg_resources", sys.modules.get("pkg_resources"))
    if sys.modules["pkg_resources"] is None:
        del sys.modules["pkg_resources"]
    monkeypatch.setattr(sys, "path", [str(_GPU), *sys.path])
    compat.install()
    df11_model = _module("df11_model")
    from dfloat11 import dfloat11 as D

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    plain = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    want = {k: v.clone() for k, v in plain.state_dict().items()}
    coded = copy_of(plain)
    monkeypatch.setattr(D, "encode_weights", df11_model._encode_weights)
    out = tmp_path / "df11"
    D.compress_model(coded, df11_model.LLAMA_PATTERNS, str(out), save_single_file=True,
                     check_correctness=False)  # the check runs DFloat11's kernel
    coded.config.save_pretrained(out)  # as df11_model.py does
    model = compat.load(str(out), "cpu")
    assert type(model) is transformers.LlamaForCausalLM
    for i, layer in enumerate(model.model.layers):
        assert layer.encoded_exponent.dtype == torch.uint8 and layer._forward_pre_hooks
        injected = layer.weight_injection_modules
        assert len(injected) == 7
        assert all("weight" not in m._parameters for m in injected)
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            assert torch.equal(layer.get_parameter(name), want[f"model.layers.{i}.{name}"])
    for m in (model.model.embed_tokens, model.lm_head):
        assert "weight" not in m._parameters and m._forward_pre_hooks
    assert torch.equal(model.model.norm.weight, want["model.norm.weight"])
    ids = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad(), pytest.raises(RuntimeError, match="no GPU here"):
        model(ids)  # the forward decodes with DFloat11's kernel: on the GPU machine


def copy_of(model):
    import copy

    return copy.deepcopy(model)
