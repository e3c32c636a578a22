"""The compressor protocol: declared capabilities and the method registry."""
import pytest
import torch

from fusionring.compression import (Compression, Compressor, FP16Compressor, NMCompressor,
                                    NoneCompressor, capabilities, lookup_compressor,
                                    register_compressor, registered_compressors)
from fusionring.compression import base


def test_builtin_methods_declare_their_capabilities():
    none, fp16, nm = (capabilities(c) for c in (Compression.none, Compression.fp16,
                                                Compression.nm(2, 4)))
    assert (none.identity, none.summable, none.elementwise) == (True, True, True)
    assert (fp16.summable, fp16.reduces_into, fp16.elementwise, fp16.in_runtime) == (
        True, True, True, False)
    assert (nm.in_runtime, nm.stateful, nm.elementwise) == (True, True, False)
    assert nm.name == "nm(2:4,float32,shared,ef=1)"  # the instance's own, agreed by ranks


def test_a_horovod_style_class_gets_the_defaults_whatever_methods_it_has():
    class Plain:
        @staticmethod
        def compress(tensor):
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor

        in_runtime = True  # not a Compressor: an attribute is not a declaration

        def state_dict(self):
            return {}

    caps = capabilities(Plain)
    assert caps == capabilities(Plain())
    assert (caps.name, caps.summable, caps.in_runtime, caps.stateful, caps.reduces_into) == (
        "Plain", None, False, False, False)


def test_a_subclass_inherits_and_overrides_declarations():
    class Quiet(FP16Compressor):
        name = "quiet"
        reduces_into = False

    caps = capabilities(Quiet)
    assert (caps.name, caps.summable, caps.reduces_into, caps.elementwise) == (
        "quiet", True, False, True)


def test_a_registered_method_is_reached_by_name(monkeypatch):
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))

    @register_compressor("scaled")
    class Scaled(Compressor):
        summable = True

        @staticmethod
        def compress(tensor):
            return tensor * 2, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor / 2

    assert Compression.scaled is Scaled and lookup_compressor("scaled") is Scaled
    assert "scaled" in registered_compressors() and "scaled" in dir(Compression)
    payload, ctx = Compression.scaled.compress(torch.ones(3))
    assert torch.equal(Compression.scaled.decompress(payload, ctx), torch.ones(3))
    with pytest.raises(ValueError, match="already registered"):
        register_compressor("scaled", NoneCompressor)
    with pytest.raises(ValueError, match="identifier"):
        register_compressor("two words", NoneCompressor)


def test_unknown_names_fail_naming_the_registered_ones():
    with pytest.raises(AttributeError, match="fp16, nm, none"):
        Compression.topk
    with pytest.raises(ValueError, match="unknown compressor 'topk'"):
        lookup_compressor("topk")


def test_horovod_names_are_the_same_objects():
    assert Compression.none is NoneCompressor and Compression.fp16 is FP16Compressor
    assert isinstance(Compression.nm(1, 4), NMCompressor)
    assert Compression.nm(2, 4) is not Compression.nm(2, 4)  # a factory: state per call


def test_a_class_with_instance_methods_is_built_where_it_is_passed():
    class Scale(Compressor):
        def __init__(self):
            self.calls = 0

        def compress(self, tensor):
            self.calls += 1
            return tensor * 2, None

        def decompress(self, tensor, ctx):
            return tensor / 2

    class NeedsArgs(Scale):
        def __init__(self, factor):
            super().__init__()

    built = base.resolve_compressor(Scale)
    assert isinstance(built, Scale) and built.compress(torch.ones(2))[0].tolist() == [2.0, 2.0]
    instance = Scale()
    assert base.resolve_compressor(instance) is instance
    # Horovod's classes with static methods are used as they are
    assert base.resolve_compressor(Compression.none) is Compression.none
    assert base.resolve_compressor(Compression.fp16) is Compression.fp16
    with pytest.raises(ValueError, match=r"NeedsArgs\(\.\.\.\)"):
        base.resolve_compressor(NeedsArgs)


def test_only_named_compressors_are_given_the_tensor_name():
    seen = []

    class Named(Compressor):
        named = True

        def compress(self, tensor, name=None):
            seen.append(name)
            return tensor, None

    class Plain(Compressor):
        def compress(self, tensor):   # would fail if given name=
            seen.append("plain")
            return tensor, None

    base.compress_named(Named(), torch.ones(1), "layer.weight")
    base.compress_named(Plain(), torch.ones(1), "layer.weight")
    assert seen == ["layer.weight", "plain"]
    assert capabilities(Compression.nm(2, 4)).named and capabilities(Compression.cluster()).named


@pytest.mark.parametrize("method", ["nm", "cluster"])
def test_lossy_codecs_take_float64_and_refuse_integers_naming_the_tensor(method):
    codec = Compression.nm(4, 4) if method == "nm" else Compression.cluster(k=2, sample=8)
    x = torch.linspace(-1, 1, 16, dtype=torch.float64)
    payload, ctx = codec.compress(x, name="w")
    out = codec.decompress(payload.float() if method == "nm" else payload, ctx)
    assert out.dtype == torch.float64 and out.shape == x.shape
    if method == "nm":   # dense 4:4 with float32 values: float32 rounding only
        assert torch.allclose(out, x, atol=1e-7)
    with pytest.raises(ValueError, match="tensor 'w' is int64"):
        codec.compress(torch.arange(8), name="w")
