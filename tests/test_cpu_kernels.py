"""Packed linears: bf16 ones give one-row steps what the plain layers give, bit for bit, and blocks too where a
block's rows round as each row alone; float32 ones keep one-row steps bit for bit and wider inputs within float32
rounding, and decode plain decoding's tokens; both switch on and off cleanly. The CPU facts that choose the fastest
exact setting are read from the CPU itself."""

import pytest
import torch

from conftest import needs_exact_bf16, needs_onednn_bf16, tiny_drafter, tiny_target
from dflash2_hf.cpu import kernels as cpu_kernels
from dflash2_hf.cpu.kernels import PackedLinears, fastest_exact_setting, packed_linears_supported

PROMPT = torch.tensor([[5, 17, 33, 2, 71, 8]])
needs_onednn_float32 = pytest.mark.skipif(not packed_linears_supported(torch.float32),
                                          reason="this PyTorch has no oneDNN")


@pytest.fixture(scope="module")
def bf16_target():
    return tiny_target("qwen3", seed=1).to(torch.bfloat16)


@pytest.fixture(scope="module")
def bf16_drafter():
    return tiny_drafter("dflash2", seed=4).to(torch.bfloat16)


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 5, 25])
def test_every_packed_layer_gives_the_plain_layers_output_bit_for_bit(bf16_target, bf16_drafter, rows):
    layers = [m for model in (bf16_target, bf16_drafter) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(1, rows, layer.in_features).to(torch.bfloat16) for layer in layers]
    with torch.no_grad():
        plain = [layer(x) for layer, x in zip(layers, inputs)]
        with PackedLinears(bf16_target, bf16_drafter):
            packed = [layer(x) for layer, x in zip(layers, inputs)]
    assert all(torch.equal(a, b) for a, b in zip(plain, packed))


@needs_onednn_bf16
@pytest.mark.parametrize("tree_nodes", [0, 6])
def test_decoding_with_packed_linears_gives_the_same_tokens(bf16_target, bf16_drafter, tree_nodes):
    def decode(**kwargs):
        return bf16_target.generate(PROMPT, max_new_tokens=24, do_sample=False, **kwargs)

    ours = dict(assistant_model=bf16_drafter, dflash_tree_nodes=tree_nodes)
    plain, drafted = decode(), decode(**ours)
    with PackedLinears(bf16_target, bf16_drafter):
        assert torch.equal(decode(), plain)
        assert torch.equal(decode(**ours), drafted)
    assert len(bf16_drafter.last_generation_stats.acceptance_lengths) > 1, "drafted cycles ran"


@needs_onednn_bf16
def test_layers_with_a_bias_give_the_same_tokens_packed():
    target = tiny_target("qwen2", seed=2).to(torch.bfloat16)  # Qwen2: q, k and v projections carry biases
    assert target.model.layers[0].self_attn.q_proj.bias is not None
    plain = target.generate(PROMPT, max_new_tokens=24, do_sample=False)
    with PackedLinears(target):
        assert torch.equal(target.generate(PROMPT, max_new_tokens=24, do_sample=False), plain)


@needs_onednn_bf16
def test_disable_gives_each_layer_its_own_forward_back(bf16_target):
    packed = PackedLinears(bf16_target).enable()
    assert all("forward" in vars(layer) for layer in packed.layers)
    packed.disable()
    assert not any("forward" in vars(layer) for layer in packed.layers)


@needs_onednn_bf16
def test_enable_repacks_a_weight_changed_since_it_was_packed():
    target = tiny_target("qwen3", seed=1).to(torch.bfloat16)
    layer = target.lm_head
    hidden = torch.randn(1, 3, layer.in_features).to(torch.bfloat16)
    packed = PackedLinears(target)
    with packed, torch.no_grad():
        before = layer(hidden)
    with torch.no_grad():
        layer.weight.mul_(2)
    with packed, torch.no_grad():
        after = layer(hidden)
    assert not torch.equal(before, after)
    assert torch.equal(after, torch.nn.functional.linear(hidden, layer.weight))


@needs_onednn_bf16
def test_weights_of_mixed_dtypes_are_refused_by_layer_name(bf16_target):
    with pytest.raises(ValueError, match=r"all of one dtype; model\.layers\.0\.self_attn\.q_proj holds torch\.float32 "
                                         r"on cpu where the first layer holds torch\.bfloat16"):
        PackedLinears(bf16_target, tiny_target("qwen3", seed=1))


@needs_onednn_float32
@pytest.mark.parametrize("rows", [1, 5, 25])
def test_packed_float32_layers_keep_one_row_bit_for_bit_and_wider_inputs_within_rounding(rows):
    target, drafter = tiny_target("qwen2", seed=2), tiny_drafter("dflash2", seed=4)  # Qwen2: biased projections
    layers = [m for model in (target, drafter) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(1, rows, layer.in_features) for layer in layers]
    with torch.no_grad():
        plain = [layer(x) for layer, x in zip(layers, inputs)]
        with PackedLinears(target, drafter):
            packed = [layer(x) for layer, x in zip(layers, inputs)]
    if rows == 1:
        assert all(torch.equal(a, b) for a, b in zip(plain, packed))
    else:
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(plain, packed))


@needs_onednn_float32
@pytest.mark.parametrize("tree_nodes", [0, 6])
def test_decoding_on_packed_float32_linears_gives_plain_decodings_tokens(tree_nodes):
    target, drafter = tiny_target("qwen3", seed=1), tiny_drafter("dflash2", seed=4)
    plain = target.generate(PROMPT, max_new_tokens=24, do_sample=False)
    with PackedLinears(target, drafter):
        assert torch.equal(target.generate(PROMPT, max_new_tokens=24, do_sample=False), plain)
        drafted = target.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                                  dflash_tree_nodes=tree_nodes)
    assert torch.equal(drafted, plain)
    assert len(drafter.last_generation_stats.acceptance_lengths) > 1, "drafted cycles ran"


@pytest.mark.parametrize(("flags", "dtype", "kernels"), [
    ({"avx2", "avx512f", "amx_bf16"}, "bfloat16", (True, True)),
    ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16", (True, True)),
    ({"avx2", "avx512f"}, "float32", (True, False)),  # AVX-512 without bf16 instructions: bf16 is emulated
    ({"avx2"}, "float32", (True, False)),
])
def test_the_fastest_exact_setting_follows_the_cpus_bf16_instructions(monkeypatch, flags, dtype, kernels):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_kernels, "_cpuinfo", lambda: ("a CPU", frozenset(flags)))
    monkeypatch.setattr(cpu_kernels, "packed_linears_supported", lambda dtype=torch.bfloat16: True)
    monkeypatch.setattr(cpu_kernels, "bf16_rows_independent", lambda: True)
    setting = fastest_exact_setting()
    assert (setting.dtype, (setting.packed_linears, setting.exact_attention)) == (dtype, kernels)
    assert ("has no bf16 matmul instructions" in setting.reason) is (dtype == "float32")


@pytest.mark.parametrize("flags", [{"avx2", "avx512f", "avx512_bf16"}, {"avx2", "avx512f", "amx_bf16"}])
def test_bf16_instructions_whose_blocks_round_differently_from_single_rows_get_float32(monkeypatch, flags):
    """As on an AMD EPYC with AVX512-BF16 (Zen 4): bf16 is fast there, but a drafted block would not give plain
    decoding's tokens, so the exact setting is float32, and the reason says so."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_kernels, "_cpuinfo", lambda: ("a CPU", frozenset(flags)))
    monkeypatch.setattr(cpu_kernels, "packed_linears_supported", lambda dtype=torch.bfloat16: True)
    monkeypatch.setattr(cpu_kernels, "bf16_rows_independent", lambda: False)
    setting = fastest_exact_setting()
    assert (setting.dtype, setting.packed_linears, setting.exact_attention) == ("float32", True, False)
    assert "round some values of a many-token block differently from the same token alone" in setting.reason


def float64_linear(rows, weight, bias=None):
    """A linear whose every row is computed on its own terms: float64 products, one rounding."""
    return (rows.double() @ weight.double().T).to(rows.dtype)


def one_ulp_up_at(height):
    """A float64 linear that rounds every value of a block of ``height`` rows (None: of every block) one ulp up."""
    def linear(rows, weight, bias=None):
        out = float64_linear(rows, weight)
        return out.nextafter(out + 1) if height in (None, rows.shape[0]) else out
    return linear


@pytest.fixture
def row_probe_kernels(monkeypatch):
    """The probe run afresh on stand-ins for both bf16 kernels (own forward and packed), each a float64 linear
    unless a test swaps one: ``row_probe_kernels("own" | "packed", linear)``."""
    def use(kernel, linear):
        if kernel == "own":
            monkeypatch.setattr(torch.nn.functional, "linear", linear)
        else:
            monkeypatch.setattr(cpu_kernels, "_onednn_linear", lambda packed, bias, rows: linear(rows, packed))

    monkeypatch.setattr(cpu_kernels, "packed_linears_supported", lambda dtype=torch.bfloat16: True)
    monkeypatch.setattr(cpu_kernels, "_onednn_pack", lambda weight: weight)
    use("own", float64_linear)
    use("packed", float64_linear)
    cpu_kernels._bf16_rows_independent.cache_clear()
    yield use
    cpu_kernels._bf16_rows_independent.cache_clear()


def test_bf16_rows_count_as_independent_where_a_block_gives_each_row_its_result_alone(row_probe_kernels):
    assert cpu_kernels.bf16_rows_independent()


@pytest.mark.parametrize("kernel", ["own", "packed"])
@pytest.mark.parametrize("height", cpu_kernels.ROW_PROBE_HEIGHTS)
def test_negative_control_a_block_of_one_height_rounding_differently_is_caught(row_probe_kernels, kernel, height):
    row_probe_kernels(kernel, one_ulp_up_at(height))
    assert not cpu_kernels.bf16_rows_independent()


def test_negative_control_packed_linears_rounding_unlike_the_layers_own_forward_are_caught(row_probe_kernels):
    """Rows independent in each kernel, but the packed one gives other results: bf16 decoding on packed linears
    would not give plain decoding's tokens."""
    row_probe_kernels("packed", one_ulp_up_at(None))
    assert not cpu_kernels.bf16_rows_independent()


@needs_onednn_bf16
@pytest.mark.slow
def test_the_row_probe_agrees_with_smollm2s_own_layers_on_a_real_block():
    """The probe's random layers stand for a real model's: SmolLM2-135M's linear layers in bf16, on the hidden states
    of a 32-token HumanEval prompt, give each row what it gives alone, with their own forward and packed (and
    packed what their own forward gives), exactly where the probe says rows are independent (on the AMD EPYC with
    AVX512-BF16 measured, its 1536-wide down projections do not)."""
    from dflash2_hf.measuring.evaluation import benchmark_prompts
    from dflash2_hf.presets import load_target

    target, tokenizer = load_target("smollm2-135m", dtype=torch.bfloat16)
    (_, prompt), = benchmark_prompts(tokenizer, ["humaneval"], 1)
    inputs = {}

    def keep_input(layer, args):
        inputs[layer] = args[0][0]

    hooks = [layer.register_forward_pre_hook(keep_input) for layer in target.modules()
             if isinstance(layer, torch.nn.Linear)]
    with torch.no_grad():
        target(prompt[:, :32])
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        own = {layer: layer(block) for layer, block in inputs.items()}
        rows_alike = all(cpu_kernels.rows_match_alone(layer, block) for layer, block in inputs.items())
        with PackedLinears(target):
            rows_alike &= all(cpu_kernels.rows_match_alone(layer, block) and torch.equal(layer(block), own[layer])
                              for layer, block in inputs.items())
    assert rows_alike is cpu_kernels.bf16_rows_independent()


@pytest.mark.parametrize(("limit", "native"), [("AVX2", False), ("avx512_core", False), ("AVX512_CORE_AMX", True),
                                               ("AVX512_CORE_BF16", True), ("ALL", True)])
def test_bf16_counts_as_native_only_where_onednn_may_use_the_bf16_instructions(monkeypatch, limit, native):
    monkeypatch.setattr(cpu_kernels, "_cpuinfo", lambda: ("a CPU", frozenset({"avx2", "avx512f", "amx_bf16"})))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", limit)
    assert cpu_kernels.native_bf16_matmuls() is native


def test_linears_count_as_packed_only_while_packed_linears_are_enabled():
    target = tiny_target(dtype=torch.float32)
    assert not cpu_kernels.linears_packed(target)
    with PackedLinears(target):
        assert cpu_kernels.linears_packed(target)
    assert not cpu_kernels.linears_packed(target)


def test_the_cpu_is_described_by_model_name_the_flags_that_matter_and_any_isa_limit(monkeypatch):
    for variable in cpu_kernels.ISA_LIMITS:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(cpu_kernels, "_cpuinfo", lambda: ("AMD EPYC 7B13", frozenset({"avx2", "fma", "sse4_2"})))
    assert cpu_kernels.cpu_description() == f"AMD EPYC 7B13 (avx2; {torch.get_num_threads()} threads)"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert cpu_kernels.cpu_description().endswith("threads; kernels limited by ATEN_CPU_CAPABILITY=avx2)")


@pytest.mark.skipif(packed_linears_supported(), reason="this CPU has oneDNN bf16 matmuls")
def test_a_cpu_without_onednn_bf16_is_refused(bf16_target):
    with pytest.raises(ValueError, match="need a CPU whose bf16 matmuls run through oneDNN"):
        PackedLinears(bf16_target)


@pytest.fixture(scope="module")
def smollm2_bf16():
    """The real SmolLM2-135M, its shipped drafter (both bf16) and one HumanEval prompt."""
    from dflash2_hf import DFlashDraftModel
    from dflash2_hf.measuring.evaluation import benchmark_prompts
    from dflash2_hf.presets import default_drafter_folder, load_target

    target, tokenizer = load_target("smollm2-135m", dtype=torch.bfloat16)
    drafter = DFlashDraftModel.from_pretrained(default_drafter_folder("smollm2-135m"), dtype=torch.bfloat16).eval()
    (_, prompt), = benchmark_prompts(tokenizer, ["humaneval"], 1)
    return target, drafter, prompt


@needs_onednn_bf16
@pytest.mark.slow
def test_smollm2_decodes_plain_decodings_tokens_on_packed_bf16_linears(smollm2_bf16):
    """Plain decoding's one-token steps get the plain layers' results packed, so the same tokens, on every CPU whose
    bf16 linears pack (oneDNN's own choice of kernels for SmolLM2-135M's shapes)."""
    target, drafter, prompt = smollm2_bf16
    plain = target.generate(prompt, max_new_tokens=48, do_sample=False)
    with PackedLinears(target, drafter):
        assert torch.equal(target.generate(prompt, max_new_tokens=48, do_sample=False), plain)


@needs_exact_bf16
@pytest.mark.slow
def test_smollm2_decodes_the_same_tokens_with_its_drafter_on_packed_bf16_linears(smollm2_bf16):
    """Where a bf16 block's rows round as each row alone (the probe), drafted blocks get the same results packed as
    unpacked, so the default tree + lookup decodes the same tokens."""
    target, drafter, prompt = smollm2_bf16
    ours = target.generate(prompt, max_new_tokens=48, do_sample=False, assistant_model=drafter)
    with PackedLinears(target, drafter):
        assert torch.equal(target.generate(prompt, max_new_tokens=48, do_sample=False, assistant_model=drafter), ours)


@needs_onednn_float32
@pytest.mark.slow
def test_smollm2_decodes_plain_decodings_tokens_on_packed_float32_linears():
    """The real SmolLM2-135M and its shipped drafter in float32, one HumanEval and one MT-Bench prompt: plain decoding
    and the default plan on packed float32 linears give unpacked plain decoding's tokens."""
    from dflash2_hf import DFlashDraftModel
    from dflash2_hf.measuring.evaluation import benchmark_prompts
    from dflash2_hf.presets import default_drafter_folder, load_target

    target, tokenizer = load_target("smollm2-135m", dtype=torch.float32)
    drafter = DFlashDraftModel.from_pretrained(default_drafter_folder("smollm2-135m"), dtype=torch.float32).eval()
    for _, prompt in benchmark_prompts(tokenizer, ["humaneval", "mtbench"], 1):
        plain = target.generate(prompt, max_new_tokens=64, do_sample=False)
        with PackedLinears(target, drafter):
            assert torch.equal(target.generate(prompt, max_new_tokens=64, do_sample=False), plain)
            assert torch.equal(target.generate(prompt, max_new_tokens=64, do_sample=False, assistant_model=drafter),
                               plain)


def packed_during_calls(target, drafter, calls: int = 1, **options) -> list[bool]:
    """Whether the target's linears ran packed, at each target forward of ``calls`` drafted greedy generations."""
    from dflash2_hf.cpu.kernels import linears_packed

    seen = []
    hook = target.register_forward_pre_hook(lambda module, args: seen.append(linears_packed(target)))
    try:
        for _ in range(calls):
            out = target.generate(PROMPT, max_new_tokens=16, do_sample=False, assistant_model=drafter, **options)
    finally:
        hook.remove()
    assert torch.equal(out, target.generate(PROMPT, max_new_tokens=16, do_sample=False)), "plain decoding's tokens"
    return seen


@needs_onednn_float32
def test_a_float32_call_runs_on_packed_linears_and_gives_the_models_back_as_they_were():
    from dflash2_hf.cpu.kernels import linears_packed

    target, drafter = tiny_target("qwen3", seed=1), tiny_drafter("dflash2", seed=4)
    seen = packed_during_calls(target, drafter)
    assert seen and all(seen), "every target forward of the call ran packed"
    assert not linears_packed(target) and not linears_packed(drafter), "outside the call the layers are their own"


@needs_onednn_float32
def test_packed_linears_can_be_switched_off_for_a_call():
    target, drafter = tiny_target("qwen3", seed=1), tiny_drafter("dflash2", seed=4)
    seen = packed_during_calls(target, drafter, dflash_packed_linears=False)
    assert seen and not any(seen)


@needs_onednn_float32
def test_later_calls_reuse_the_packed_weights_and_they_go_with_the_models():
    import gc

    from dflash2_hf.cpu.kernels import PACKED_WEIGHTS

    target, drafter = tiny_target("qwen3", seed=1), tiny_drafter("dflash2", seed=4)
    layers = [m for model in (target, drafter) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packed_during_calls(target, drafter)
    first = {id(layer): id(PACKED_WEIGHTS[layer][1]) for layer in layers}
    count = len(PACKED_WEIGHTS)
    packed_during_calls(target, drafter, calls=3)
    assert {id(layer): id(PACKED_WEIGHTS[layer][1]) for layer in layers} == first, "packed once, reused"
    assert len(PACKED_WEIGHTS) == count, "no copy more however many calls"
    del target, drafter, layers
    gc.collect()
    assert len(PACKED_WEIGHTS) == count - len(first), "dropped with the models"


def test_packed_linears_takes_true_or_false_only():
    target, drafter = tiny_target("qwen3", seed=1), tiny_drafter("dflash2", seed=4)
    with pytest.raises(ValueError, match=r"packed_linears must be True or False, got 'no' \(str\)"):
        target.generate(PROMPT, max_new_tokens=4, do_sample=False, assistant_model=drafter,
                        dflash_packed_linears="no")


@needs_onednn_float32
def test_a_drafter_running_under_autocast_decodes_packed_as_it_does_unpacked():
    # as accelerate prepares a model for bf16 mixed precision: its forward runs under autocast
    target, drafter = tiny_target("qwen3", seed=1), tiny_drafter("dflash2", seed=4)
    drafter.forward = torch.autocast("cpu", dtype=torch.bfloat16)(drafter.forward)
    settings = dict(max_new_tokens=16, do_sample=False, assistant_model=drafter)
    assert torch.equal(target.generate(PROMPT, **settings), target.generate(PROMPT, dflash_packed_linears=False,
                                                                            **settings))


def drafter_packed_during_calls(target, drafter, calls: int = 1) -> list[tuple[bool, torch.dtype]]:
    """Whether the drafter the decoder drafts with ran packed, and in which dtype, at each of its forwards during
    ``calls`` drafted greedy generations (each checked against plain decoding's tokens)."""
    from dflash2_hf.cpu.kernels import linears_packed
    from dflash2_hf.modeling import DFlashDraftModel

    seen = []
    original = DFlashDraftModel.forward

    def watched(self, *args, **kwargs):
        seen.append((linears_packed(self), self.dtype))
        return original(self, *args, **kwargs)

    DFlashDraftModel.forward = watched
    try:
        for _ in range(calls):
            out = target.generate(PROMPT, max_new_tokens=16, do_sample=False, assistant_model=drafter)
    finally:
        DFlashDraftModel.forward = original
    assert torch.equal(out, target.generate(PROMPT, max_new_tokens=16, do_sample=False)), "plain decoding's tokens"
    return seen


@needs_onednn_float32
def test_a_bf16_drafter_next_to_a_float32_target_drafts_packed_in_float32_and_stays_as_it_was():
    # from_pretrained loads the shipped drafter in bf16, its saved dtype; the README's three lines pass it as it is
    from dflash2_hf.cpu.kernels import linears_packed

    target, drafter = tiny_target("qwen3", seed=1), tiny_drafter("dflash2", seed=4).to(torch.bfloat16)
    before = {name: weight.clone() for name, weight in drafter.state_dict().items()}
    seen = drafter_packed_during_calls(target, drafter)
    assert seen and all(seen_packed and dtype == torch.float32 for seen_packed, dtype in seen)
    assert drafter.dtype == torch.bfloat16 and not linears_packed(drafter)
    assert all(torch.equal(weight, before[name]) for name, weight in drafter.state_dict().items())


@needs_onednn_float32
def test_the_float32_copy_of_a_drafter_is_made_once_and_remade_when_its_weights_change():
    import gc

    from dflash2_hf.cpu.kernels import DRAFTER_COPIES, drafter_for_the_call

    target, drafter = tiny_target("qwen3", seed=1), tiny_drafter("dflash2", seed=4).to(torch.bfloat16)
    first = drafter_for_the_call(target, drafter, True)
    assert first is not drafter and first.dtype == torch.float32
    assert drafter_for_the_call(target, drafter, True) is first, "reused by later calls"
    with torch.no_grad():
        next(drafter.parameters()).mul_(2)
    second = drafter_for_the_call(target, drafter, True)
    assert second is not first and torch.equal(next(second.parameters()), next(drafter.parameters()).float())
    count = len(DRAFTER_COPIES)
    del drafter, first, second
    gc.collect()
    assert len(DRAFTER_COPIES) == count - 1, "dropped with the drafter"


@pytest.mark.parametrize(("drafter_dtype", "wanted"), [(torch.float32, True), (torch.bfloat16, False)])
def test_a_drafter_is_used_as_it_is_where_no_copy_would_let_both_models_run_packed(drafter_dtype, wanted):
    from dflash2_hf.cpu.kernels import drafter_for_the_call

    target, drafter = tiny_target("qwen3", seed=1), tiny_drafter("dflash2", seed=4).to(drafter_dtype)
    assert drafter_for_the_call(target, drafter, wanted) is drafter
