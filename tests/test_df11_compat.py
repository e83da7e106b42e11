"""The DFloat11 side-by-side's glue (gpu/df11_compat.py, df11_codec.py, df11_model.py,
resident_check.py's plain model) on the CPU.

Always: the shim gives transformers 5's ``no_init_weights`` and a ``pkg_resources`` where
DFloat11 0.5.0 imports them; the reference decoder reads DFloat11's table layout; the
bf16 model resident_check compares with is the model its saved checkpoint loads as, buffers
included. Where the ``dfloat11`` and ``dahuffman`` packages are installed (the GPU
machine's wheels, so those tests carry the ``cuda`` marker and run there: ``python3 -m
pytest -m cuda tests/test_df11_compat.py``), DFloat11's own ``compress_model`` codes a tiny
Llama saved as resident_check saves it and ``DFloat11Model.from_pretrained`` loads it
through the shim with the reference decode in its kernel's place: every weight and buffer
the plain model's, and its logits too; with a GPU, the same through DFloat11's kernel.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_GPU = Path(__file__).resolve().parents[1] / "gpu"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, _GPU / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # as an import would (its dataclasses look it up there)
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


def _rc():
    """gpu/resident_check.py, imported from its file (gpu/ on the path for its imports)."""
    if str(_GPU) not in sys.path:
        sys.path.insert(0, str(_GPU))
    return _module("resident_check")


def test_reference_decode_reads_dfloat11_tables() -> None:
    """``decode_reference`` on a hand-made table of DFloat11's layout (codes of 1 to 9
    bits, the two 9-bit ones through a second table): every value back, sign and mantissa
    bits included; codes that end early raise."""
    codec = _module("df11_codec")
    codes = {118 + k: "1" * k + "0" for k in range(8)}  # 0, 10, ..., 11111110
    codes |= {126: "111111110", 127: "111111111"}
    luts = torch.zeros(3, 256, dtype=torch.uint8)
    for sym, code in codes.items():
        luts[2, sym] = len(code)
        if len(code) <= 8:
            lo = int(code.ljust(8, "0"), 2)
            luts[0, lo : lo + (1 << (8 - len(code)))] = sym
    luts[0, 0xFF] = 255  # 256 - 1: the next byte in table 1
    luts[1, :128], luts[1, 128:] = 126, 127
    g = torch.Generator().manual_seed(0)
    exps = torch.randint(118, 128, (5000,), generator=g)
    other = torch.randint(0, 256, (5000,), generator=g, dtype=torch.int32)
    stream = "".join(codes[int(e)] for e in exps)
    stream += "0" * (-len(stream) % 8)
    encoded = torch.tensor([int(stream[i : i + 8], 2) for i in range(0, len(stream), 8)],
                           dtype=torch.uint8)
    want = ((other & 0x80) << 8) | (exps << 7) | (other & 0x7F)
    got = codec.decode_reference(luts, encoded, other.to(torch.uint8))
    assert got.dtype == torch.int16
    assert torch.equal(got.to(torch.int32) & 0xFFFF, want.to(torch.int32))
    with pytest.raises(ValueError, match="end before"):
        codec.decode_reference(luts, encoded[: encoded.numel() // 2], other.to(torch.uint8))


def test_saved_plain_model_is_the_compared_one(tmp_path, monkeypatch) -> None:
    """``--save-plain`` writes the model resident_check compares with, built on
    ``--device``: loaded back (as DFloat11's loader and ``from_pretrained`` build it), its
    every weight and buffer and its logits over a prompt are the compared model's bit for
    bit (the rotary frequencies stay float32 in both)."""
    rc = _rc()
    built = []
    real = rc.llama

    def llama(size, device, fp8=False, layers=None):
        built.append((size, device, layers))
        return real(size, "cpu", fp8, layers)

    monkeypatch.setattr(rc, "llama", llama)
    out = tmp_path / "plain"
    assert rc.main(["--device", "meta", "--size", "tiny", "--layers", "2",
                    "--save-plain", str(out)]) == 0
    assert built == [("tiny", "meta", 2)]  # the checks' device, not always the CPU
    plain = real("tiny", "cpu", layers=2)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    want = {**dict(plain.named_buffers()), **plain.state_dict()}
    got = {**dict(loaded.named_buffers()), **loaded.state_dict()}
    assert set(got) == set(want) and len(plain.model.layers) == 2
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    ids = rc._ids(plain.config.vocab_size, 2, 17, "cpu", 0)
    with torch.no_grad():
        assert torch.equal(rc._bits(loaded.eval()(ids).logits), rc._bits(plain(ids).logits))


def _last_bit(t) -> None:
    """``t`` (float32) with its first value one unit in the last place larger."""
    t.view(torch.int32)[0] += 1


def test_comparison_is_of_what_a_checkpoint_stores(capsys) -> None:
    """Two models whose rotary frequencies (computed, stored by no checkpoint) differ in
    the last bit, as when one was built on a GPU: every stored entry equal, so the
    comparison passes, names the computed buffers and copies the plain model's in (the
    logits are then the plain model's); a stored weight one apart fails, naming it,
    however equal the computed buffers."""
    rc = _rc()
    compat = _module("df11_compat")
    plain, model = rc.llama("tiny", "cpu", layers=2), rc.llama("tiny", "cpu", layers=2)
    assert sorted(compat.computed_buffers(plain)) == [
        "model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    _last_bit(model.model.rotary_emb.inv_freq)
    assert compat.weight_mismatches(model, plain) == []
    assert compat.computed_mismatches(model, plain) == ["model.rotary_emb.inv_freq: other values"]
    ids = rc._ids(plain.config.vocab_size, 2, 17, "cpu", 3)
    with torch.no_grad():
        assert rc.df11_compare("tiny", model, plain, "DIR") == []
        assert torch.equal(rc._bits(model(ids).logits), rc._bits(plain(ids).logits))
    line = capsys.readouterr().out
    assert "every other stored weight and buffer the plain model's bit for bit" in line
    assert ("computed buffers (model.rotary_emb.inv_freq, model.rotary_emb.original_inv_freq)"
            ": model.rotary_emb.inv_freq differ, the plain model's copied in") in line
    assert compat.computed_mismatches(model, plain) == []
    assert rc.df11_compare("tiny", model, plain, "DIR") == []
    assert capsys.readouterr().out.endswith(
        "model.rotary_emb.original_inv_freq): the plain model's bit for bit\n")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] += 1
    _last_bit(model.model.rotary_emb.original_inv_freq)
    assert rc.df11_compare("tiny", model, plain, "DIR") == [
        "tiny: DFloat11's model from DIR is not the plain model (1 stored entries differ, "
        "e.g. model.layers.1.mlp.up_proj.weight: other values)"]


def test_side_by_side_prints_the_times_whatever_the_verdict(capsys, monkeypatch) -> None:
    """The DFloat11 rows (decode-step times at batch 1 and 64 beside the plain model's)
    are printed after the comparison with its verdict beside them: also where the model
    is another one (a failure, returned), where no logits are compared. (Timing stubbed:
    what is printed is the point here.)"""
    rc = _rc()
    monkeypatch.setattr(rc, "_time", lambda fn, device, n=20: 2.0)
    monkeypatch.setattr(rc, "_generate_rate", lambda model, ids, device, new=32: 50.0)
    plain, model = rc.llama("tiny", "cpu", layers=2), rc.llama("tiny", "cpu", layers=2)
    with torch.no_grad():
        assert rc.df11_side_by_side("tiny", model, plain, "DIR", "cpu") == []
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == [
        "  DFloat11", "  DFloat11 logits, 17-token prompt",
        "  DFloat11 logits, decode step, batch 1", "  DFloat11 logits, decode step, batch 64",
        "  DFloat11 decode step, batch 1", "  DFloat11 decode step, batch 64"]
    assert all(line.endswith("[the plain model's weights, logits exact]") for line in out[-2:])
    with torch.no_grad():
        model.model.embed_tokens.weight[7, 1] += 1
        fails = rc.df11_side_by_side("tiny", model, plain, "DIR", "cpu")
    assert fails == ["tiny: DFloat11's model from DIR is not the plain model (1 stored "
                     "entries differ, e.g. model.embed_tokens.weight: other values)"]
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[0].startswith("  DFloat11's model from DIR is not this one")
    for batch, line in zip((1, 64), out[1:], strict=True):
        assert line.startswith(f"  DFloat11 decode step, batch {batch}: eager ")
        assert "eager 2.000 ms (1.00x the plain model's 2.000 ms), generate 50 tok/s" in line
        assert line.endswith("[NOT the plain model's weights]")


def test_plain_model_computes_its_buffers_on_the_cpu() -> None:
    """``_cpu_computed`` gives a model the computed buffers of the same model built on
    the CPU (where DFloat11's loader builds its own): one built elsewhere, whose float32
    rounded otherwise, gets them back bit for bit; stored weights are left as they are."""
    rc = _rc()
    compat = _module("df11_compat")
    want = rc.llama("tiny", "cpu", layers=2)
    model = rc.llama("tiny", "cpu", layers=2)
    _last_bit(model.model.rotary_emb.inv_freq)
    _last_bit(model.model.rotary_emb.original_inv_freq)
    assert len(compat.computed_mismatches(model, want)) == 2
    rc._cpu_computed(model, model.config)
    assert compat.computed_mismatches(model, want) == []
    assert compat.weight_mismatches(model, want) == []


def _dfloat11_or_skip(monkeypatch):
    """DFloat11's module (skipping without its wheels), its kernel launch and CuPy
    restored after the test; gpu/ on the path."""
    pytest.importorskip("dahuffman")
    if importlib.util.find_spec("dfloat11") is None:
        pytest.skip("dfloat11 is not installed")
    import transformers.modeling_utils as mu

    compat = _module("df11_compat")
    monkeypatch.setattr(mu, "no_init_weights", None, raising=False)
    monkeypatch.delattr(mu, "no_init_weights")
    # what install() adds to sys.modules goes again after the test
    monkeypatch.setitem(sys.modules, "pkg_resources", sys.modules.get("pkg_resources"))
    if sys.modules["pkg_resources"] is None:
        del sys.modules["pkg_resources"]
    monkeypatch.setattr(sys, "path", [str(_GPU), *sys.path])
    compat.install()
    if importlib.util.find_spec("cupy") is None:
        monkeypatch.setitem(sys.modules, "cupy", compat._cpu_cupy())
    from dfloat11 import dfloat11 as D

    monkeypatch.setattr(D, "_decode", D._decode)  # load(..., "cpu") replaces them
    monkeypatch.setattr(D, "cp", D.cp)
    return compat, D


def _df11_of(tmp_path, device: str):
    """(plain model, its DFloat11 checkpoint's directory): a tiny Llama built and saved on
    ``device`` as resident_check does, coded by ``df11_model.build``."""
    rc = _rc()
    assert rc.main(["--device", device, "--size", "tiny", "--layers", "2",
                    "--save-plain", str(tmp_path / "plain")]) == 0
    df11_model = _module("df11_model")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain",
                                                              dtype=torch.bfloat16)
    out = tmp_path / "df11"
    df11_model.build(model, out)
    return rc.llama("tiny", device, layers=2), out


@pytest.mark.cuda
def test_dfloat11_model_is_the_plain_one(tmp_path, monkeypatch) -> None:
    """DFloat11's ``compress_model`` output of the saved plain model, loaded by
    ``DFloat11Model.from_pretrained`` through the shim with the reference decode in its
    kernel's place: each block's seven Linears, the embedding and the head coded and
    hooked, every decoded weight, norm and buffer the plain model's bit for bit, and its
    logits over a prompt and a decode step too; a model with one other weight is told, and
    one with other computed buffers apart from it."""
    compat, _D = _dfloat11_or_skip(monkeypatch)
    rc = _rc()
    plain, out = _df11_of(tmp_path, "cpu")
    model = compat.load(str(out), "cpu")
    assert type(model) is transformers.LlamaForCausalLM
    coded = [n for n, _m in compat.coded_modules(model)]
    assert coded == ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]
    for layer in model.model.layers:
        injected = layer.weight_injection_modules
        assert len(injected) == 7 and all("weight" not in m._parameters for m in injected)
    for m in (model.model.embed_tokens, model.lm_head):
        assert "weight" not in m._parameters and m._forward_pre_hooks
    assert compat.weight_mismatches(model, plain) == []
    with torch.no_grad():
        for ids in (rc._ids(plain.config.vocab_size, 2, 17, "cpu", 3),
                    rc._ids(plain.config.vocab_size, 4, 1, "cpu", 1)):
            assert torch.equal(rc._bits(model(ids).logits), rc._bits(plain(ids).logits))
        other = rc.llama("tiny", "cpu", layers=2)
        other.model.layers[1].mlp.up_proj.weight[3, 5] += 1
        assert compat.weight_mismatches(model, other) == [
            "model.layers.1.mlp.up_proj.weight: other values"]
        other.to(torch.bfloat16)  # what resident_check's plain model was: buffers cast
        assert compat.weight_mismatches(model, other) == [
            "model.layers.1.mlp.up_proj.weight: other values"]
        assert [m.split(":")[0] for m in compat.computed_mismatches(model, other)] == [
            "model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]


@pytest.mark.cuda
def test_dfloat11_model_on_the_gpu_is_the_plain_one(tmp_path, monkeypatch) -> None:
    """On the GPU: the checkpoint of the model resident_check builds there (checked by
    DFloat11's kernel as it is written), loaded by DFloat11 onto the GPU, holds every
    weight of that model bit for bit as its kernel decodes them, and the same computed
    buffers (DFloat11 builds its model on the CPU, resident_check computes them there)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    compat, _D = _dfloat11_or_skip(monkeypatch)
    plain, out = _df11_of(tmp_path, "cuda:0")
    model = compat.load(str(out), "cuda:0")
    assert compat.weight_mismatches(model, plain) == []
    assert compat.computed_mismatches(model, plain) == []  # both computed on the CPU
