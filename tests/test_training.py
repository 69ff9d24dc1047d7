"""Training recipe: loss goes down, resuming is exact, the selector loss and block masks are right, data parsing
survives truncated files."""

import copy
import json
import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import new_drafter, one_torch_thread, tiny_drafter, tiny_drafter_config, tiny_target
from dflash2_hf import DFlashDraftModel
from dflash2_hf.modeling import GroupedDynamicConv
from dflash2_hf.training.blocks import (
    IGNORE,
    block_attention,
    block_positions,
    decoding_anchors,
    position_weights,
    sample_blocks,
    selector_loss,
)
from dflash2_hf.training.data import iter_conversations, training_prompts
from dflash2_hf.training.trainer import DrafterTrainer, TrainingConfig, TrainingDiverged


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def target_answers(target, seed: int, **sampling) -> list[dict]:
    """12 records of the target's own answers (40 tokens) to random 6-token prompts, as the data step makes them."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # sampling draws from the global generator: the same answers whichever tests ran before
    rows = []
    for _ in range(12):
        prompt = torch.randint(0, 90, (1, 6), generator=generator)
        output = target.generate(prompt, max_new_tokens=40, **sampling)
        rows.append({"prompt_ids": prompt[0].tolist(), "response_ids": output[0, 6:].tolist()})
    return rows


@pytest.fixture(scope="module")
def records(target):
    """Sequences the target itself sampled."""
    return target_answers(target, seed=0, do_sample=True, temperature=0.5)


def trainer(target, records, folder, steps, drafter=None, **overrides):
    settings = dict(batch_size=4, blocks_per_sequence=4, warmup_steps=5, learning_rate=3e-3, checkpoint_every=5)
    config = TrainingConfig(output_dir=str(folder), steps=steps, **settings | overrides)
    return DrafterTrainer(drafter or new_drafter(), target, records, config)


def test_a_few_steps_reduce_drafter_and_selector_losses(target, records, tmp_path):
    history = trainer(target, records, tmp_path, steps=40).train()
    first = sum(h["drafter_loss"] for h in history[:5]) / 5
    last = sum(h["drafter_loss"] for h in history[-5:]) / 5
    assert last < 0.8 * first
    assert sum(h["selector_loss"] for h in history[-5:]) < sum(h["selector_loss"] for h in history[:5])


@pytest.mark.parametrize(("factorised", "selector_gold", "anchors"),
                         [(True, "insert", "random"), (False, "skip", "random"), (False, "insert", "decoding")])
def test_a_few_selector_steps_reduce_the_selector_loss(target, records, tmp_path, one_thread, factorised, selector_gold,
                                                       anchors):  # one thread: the same float sums on any machine
    run = trainer(target, records, tmp_path, steps=40, drafter=new_drafter(selector_factorised=factorised),
                  train_drafter=False, learning_rate=1e-2, selector_gold=selector_gold,
                  anchors=anchors)  # only the selector learns

    def selector_loss_on_fixed_batches() -> float:
        with torch.no_grad():
            return sum(run.losses(run.batch_for_step(1000 + i))[1].selector_loss for i in range(4)) / 4

    before = selector_loss_on_fixed_batches()
    run.train()
    assert selector_loss_on_fixed_batches() < 0.8 * before


def test_resuming_after_a_stop_gives_the_same_state_as_an_unbroken_run(target, records, tmp_path, one_thread):
    unbroken = trainer(target, records, tmp_path / "unbroken", steps=10)
    unbroken.train()
    trainer(target, records, tmp_path / "stopped", steps=5).train()  # "killed" after its step-5 checkpoint
    resumed = trainer(target, records, tmp_path / "stopped", steps=10)
    resumed.train()
    assert resumed.step == 10
    for (name, a), (_, b) in zip(unbroken.unwrapped.state_dict().items(), resumed.unwrapped.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_damaged_newest_checkpoint_is_skipped_for_the_newest_intact_one(target, records, tmp_path, one_thread):
    unbroken = trainer(target, records, tmp_path / "unbroken", steps=10, checkpoint_every=1)
    unbroken.train()
    stopped = trainer(target, records, tmp_path / "stopped", steps=10, checkpoint_every=1)
    save = stopped.save

    def save_then_stop():
        save()
        if stopped.step == 7:
            raise KeyboardInterrupt  # killed after its step-7 checkpoint (step 6's is kept beside it)

    stopped.save = save_then_stop
    with pytest.raises(KeyboardInterrupt):
        stopped.train()
    weights = tmp_path / "stopped" / "step-000007" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # cut short, as by a full disk
    resumed = trainer(target, records, tmp_path / "stopped", steps=10, checkpoint_every=1)
    with pytest.warns(UserWarning, match=r"Resuming from .*step-000006: the newer step-000007 \(.*\) cannot be read"):
        resumed.train()
    assert resumed.step == 10 and [h["step"] for h in resumed.history] == list(range(1, 11))
    for (name, a), (_, b) in zip(unbroken.unwrapped.state_dict().items(), resumed.unwrapped.state_dict().items()):
        assert torch.equal(a, b), name


def state_with(**fields) -> str:
    """A checkpoint's state.json as the trainer writes it, with ``fields`` replaced (``None``: left out)."""
    state = {"step": 2, "param_groups": [], "scheduler": {}, "extra": {}} | fields
    return json.dumps({name: value for name, value in state.items() if value is not None})


DAMAGED_STATES = {
    "cut short": ("{cut", "is not JSON"),
    "not UTF-8": (b"\xff\xfe{}", "is not JSON"),
    "a list": ("[1, 2]", "holds a JSON list, not the object"),
    "no step": (state_with(step=None), r"lacks or mistypes step \(expected int, found NoneType"),
    "a string step": (state_with(step="2"), r"lacks or mistypes step \(expected int, found str"),
    "a bool step": (state_with(step=True), r"lacks or mistypes step \(expected int, found bool"),
    "a number of groups": (state_with(param_groups=5), r"lacks or mistypes param_groups \(expected list, found int"),
    "a list for extra": (state_with(extra=[]), r"lacks or mistypes extra \(expected dict, found list"),
}


@pytest.mark.parametrize("damage", DAMAGED_STATES)
def test_a_run_whose_checkpoints_are_all_damaged_is_refused_not_restarted_over_them(target, records, tmp_path, damage):
    content, reason = DAMAGED_STATES[damage]
    trainer(target, records, tmp_path, steps=2, checkpoint_every=1).train()
    for state in tmp_path.glob("step-*/state.json"):
        state.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=rf"No checkpoint in .* can be read: step-000002 \(.*state\.json {reason}.*\); "
                                         r"step-000001"):
        trainer(target, records, tmp_path, steps=4, checkpoint_every=1).train()


def test_training_that_diverges_stops_naming_the_step_and_saves_nothing_from_it(target, records, tmp_path):
    run = trainer(target, records, tmp_path, steps=8, checkpoint_every=2)
    save = run.save

    def save_then_raise_the_learning_rate():  # from step 3 on, as --lr 1e12 would
        save()
        run.scheduler.base_lrs = [1e12] * len(run.scheduler.base_lrs)

    run.save = save_then_raise_the_learning_rate
    with pytest.raises(TrainingDiverged) as diverged:
        run.train()
    kept = sorted(tmp_path.glob("step-*"))[-1]
    assert re.fullmatch(rf"Training diverged at step {run.step}: (the loss is (nan|inf)|the weights hold NaN or Inf) "
                        rf"\(learning rate 0.003\). Nothing was saved from it; the last checkpoint, {kept}, is "
                        "finite. Train again with a lower --lr and a new --out.", str(diverged.value))
    assert int(kept.name.removeprefix("step-")) < run.step
    for checkpoint in sorted(tmp_path.glob("step-*")):
        assert all(bool(torch.isfinite(t).all()) for t in load_file(checkpoint / "model.safetensors").values())


def test_frozen_drafter_trains_only_the_selector(target, records, tmp_path):
    run = trainer(target, records, tmp_path, steps=3, train_drafter=False)
    before = {k: v.clone() for k, v in run.unwrapped.state_dict().items()}
    run.train()
    after = run.unwrapped.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("candidate_selector.") for k in changed)


def hand_built_case():
    """A drafter whose selector adds no pair term (scores are its logits), two positions' logits with top-4
    candidates scored 4, 3, 2, 1, and labels: anchor 9; gold 6 is candidate #2; gold 50 is not in the top 4."""
    drafter = new_drafter()
    with torch.no_grad():
        drafter.candidate_selector.hidden_projection.weight.zero_()
    logits = torch.full((1, 2, 96), -10.0)
    logits[0, 0, [5, 6, 7, 8]] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    logits[0, 1, [1, 2, 3, 4]] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    return drafter, torch.zeros(1, 2, 64), logits, torch.tensor([[9, 6, 50]])


def test_selector_loss_on_a_hand_built_case():
    loss = selector_loss(*hand_built_case())
    first = -torch.log_softmax(torch.tensor([4.0, 3.0, 2.0, 1.0]), 0)[1]
    second = -torch.log_softmax(torch.tensor([4.0, 3.0, 2.0, -10.0]), 0)[3]  # gold replaces the 4th candidate
    assert loss.item() == pytest.approx(((first + second) / 2).item(), rel=1e-5)


def test_selector_loss_can_skip_positions_whose_gold_token_is_not_a_candidate():
    loss = selector_loss(*hand_built_case(), insert_missing_gold=False)  # gold 50 is not in the top 4: adds nothing
    first = -torch.log_softmax(torch.tensor([4.0, 3.0, 2.0, 1.0]), 0)[1]
    assert loss.item() == pytest.approx((first / 2).item(), rel=1e-5)  # still averaged over both scored positions


def test_an_unknown_selector_gold_setting_is_refused():
    with pytest.raises(ValueError, match="selector_gold"):
        TrainingConfig(output_dir="unused", selector_gold="drop")


def test_a_distill_weight_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="distill_weight"):
        TrainingConfig(output_dir="unused", distill_weight=1.5)


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("steps", -1, "steps must be >= 0, got -1"),
    ("batch_size", 0, "batch_size must be >= 1, got 0"),
    ("blocks_per_sequence", 0, "blocks_per_sequence must be >= 1, got 0"),
    ("checkpoint_every", 0, "checkpoint_every must be >= 1, got 0"),
    ("heldout_fraction", 1.0, r"heldout_fraction must be in \[0, 1\)"),
    ("heldout_fraction", -0.1, r"heldout_fraction must be in \[0, 1\)"),
])
def test_training_settings_outside_their_range_are_refused(setting, value, message):
    with pytest.raises(ValueError, match=message):
        TrainingConfig(output_dir="unused", **{setting: value})


def test_training_on_records_without_an_answer_token_is_refused_before_any_step(target, tmp_path):
    empty = [{"prompt_ids": [1, 2, 3], "response_ids": []}] * 4
    with pytest.raises(ValueError, match="none of the 4 training records has an answer token to learn from"):
        trainer(target, empty, tmp_path, steps=2).train()
    assert not list(tmp_path.glob("step-*"))


def test_decoding_anchors_need_a_frozen_drafter():
    with pytest.raises(ValueError, match="needs a frozen drafter"):
        TrainingConfig(output_dir="unused", anchors="decoding")
    with pytest.raises(ValueError, match="anchors must be"):
        TrainingConfig(output_dir="unused", anchors="middle", train_drafter=False)


def test_soft_labels_are_the_targets_own_next_token_logits_at_each_drafted_position(target, records, tmp_path):
    run = trainer(target, records, tmp_path, steps=1, distill_weight=0.5)
    batch = run.batch_for_step(0)
    teacher = run.target_block_logits(batch).view(*batch.anchors.shape, -1, target.config.vocab_size)
    row, slot = 1, 2
    anchor = batch.anchors[row, slot].item()
    with torch.no_grad():
        full = target(batch.input_ids[row : row + 1][:, batch.attention_mask[row].bool()]).logits[0]
    drafted = run.unwrapped.block_size - 1
    assert torch.allclose(teacher[row, slot], full[anchor : anchor + drafted], atol=1e-4)


def test_distilling_moves_the_drafter_towards_the_target_distribution(target, records, tmp_path):
    run = trainer(target, records, tmp_path, steps=40, distill_weight=1.0)

    def divergence_on_fixed_batches() -> float:
        """Mean KL(target || drafter) over the drafted positions with a label, on four fixed batches."""
        total = 0.0
        with torch.no_grad():
            for step in range(1000, 1004):
                batch = run.batch_for_step(step)
                _, logits, labels = run._forward(batch)
                teacher = run.target_block_logits(batch).log_softmax(-1)
                kl = (teacher.exp() * (teacher - logits.log_softmax(-1))).sum(-1)
                total += kl[labels[:, 1:] != IGNORE].mean().item() / 4
        return total

    before = divergence_on_fixed_batches()
    run.train()
    assert divergence_on_fixed_batches() < 0.8 * before


def test_the_distill_weight_mixes_the_hard_and_soft_losses_linearly(target, records, tmp_path):
    batch = trainer(target, records, tmp_path / "batch", steps=1).batch_for_step(0)
    losses = {}
    for weight in (0.0, 0.5, 1.0):  # 0.0 is the default: plain cross-entropy on the chosen tokens
        run = trainer(target, records, tmp_path / str(weight), steps=1, distill_weight=weight)
        with torch.no_grad():
            losses[weight] = run.losses(batch)[1].drafter_loss
    assert abs(losses[1.0] - losses[0.0]) > 1e-4  # a random drafter: both near log(vocabulary), yet apart
    assert losses[0.5] == pytest.approx((losses[0.0] + losses[1.0]) / 2, rel=1e-5)


def test_selector_loss_ignores_positions_without_a_gold_token():
    drafter = new_drafter()
    logits = torch.randn(1, 2, 96)
    hidden = torch.randn(1, 2, 64)
    full = selector_loss(drafter, hidden, logits, torch.tensor([[9, 6, IGNORE]]))
    one = selector_loss(drafter, hidden[:, :1], logits[:, :1], torch.tensor([[9, 6]]))
    torch.testing.assert_close(full, one)


def test_blocks_see_only_context_before_their_anchor():
    mask = block_attention(torch.tensor([[2, 4]]), torch.ones(1, 6), block_size=2)[0, 0]
    assert mask.shape == (4, 6)
    assert mask[:2].tolist() == [[True, True, False, False, False, False]] * 2
    assert mask[2:].tolist() == [[True, True, True, True, False, False]] * 2


@pytest.mark.parametrize("layout", [{}, dict(is_causal=True), dict(sliding_window=3)], ids=["bidirectional", "causal",
                                                                                            "sliding window"])
def test_a_packed_block_never_sees_another_block(layout):
    drafter = tiny_drafter("dflash2", **layout)
    context = torch.randn(1, 6, 2 * 64, generator=torch.Generator().manual_seed(0))
    blocks = torch.randn(1, 3 * 8, 64, generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[2, 3, 5]])
    kwargs = dict(context_hidden_states=context, position_ids=block_positions(anchors, 6, 8),
                  attention_mask=block_attention(anchors, torch.ones(1, 6), 8), block_length=8)
    with torch.no_grad():
        before = drafter(blocks, **kwargs).last_hidden_state
        changed = blocks.clone()
        changed[:, 8:16] += 1.0  # the middle block only
        after = drafter(changed, **kwargs).last_hidden_state
    torch.testing.assert_close(after[:, :8], before[:, :8])
    torch.testing.assert_close(after[:, 16:], before[:, 16:])
    assert not torch.allclose(after[:, 8:16], before[:, 8:16])


def test_sampled_blocks_start_in_the_response_and_label_the_next_tokens():
    record = {"prompt_ids": [1, 2, 3], "response_ids": [10, 11, 12, 13]}
    batch = sample_blocks([record], block_size=3, blocks_per_sequence=8, max_length=64, generator=torch.Generator())
    anchors = sorted(a for a in batch.anchors[0].tolist() if a >= 0)
    assert anchors == [2, 3, 4, 5]  # the last prompt token up to the second-to-last token
    slot = batch.anchors[0].tolist().index(5)
    assert batch.labels[0, slot].tolist() == [12, 13, IGNORE]


def test_a_response_cut_off_by_max_length_gives_no_blocks():
    cut = {"prompt_ids": list(range(1, 9)), "response_ids": [10, 11]}
    kept = {"prompt_ids": [1, 2], "response_ids": [10, 11, 12]}
    batch = sample_blocks([cut, kept], block_size=3, blocks_per_sequence=2, max_length=6, generator=torch.Generator())
    assert (batch.anchors[0] == -1).all() and (batch.labels[0] == IGNORE).all()
    assert sorted(batch.anchors[1].tolist()) == [1, 2]


def test_position_weights_decay_exponentially():
    weights = position_weights(4, gamma=2.0)
    torch.testing.assert_close(weights, torch.exp(-torch.tensor([0.0, 0.5, 1.0])))


def test_convolution_keeps_side_by_side_blocks_apart():
    conv = GroupedDynamicConv(64, kernel_size=2, group_size=16)
    torch.nn.init.normal_(conv.base_kernel)
    torch.nn.init.normal_(conv.kernel_projection.weight)
    first, second = torch.randn(1, 4, 64), torch.randn(1, 4, 64)
    with torch.no_grad():
        together, _ = conv.prepare(torch.cat([first, second], dim=1), block_length=4)
        alone, _ = conv.prepare(second)
    torch.testing.assert_close(together[:, 4:], alone)


def test_truncated_sharegpt_file_keeps_the_complete_conversations(tmp_path):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"question {i}"},
                                                  {"from": "gpt", "value": f"answer {i}"}]} for i in range(3)]
    text = json.dumps(records)
    cut = text[: text.rindex("answer 2") + 3]  # cut in the middle of the last record
    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    conversations = list(iter_conversations(path))
    assert [c[0]["content"] for c in conversations] == ["question 0", "question 1"]
    assert conversations[0][1] == {"role": "assistant", "content": "answer 0"}


def test_jsonl_of_messages_is_read(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n")
    assert list(iter_conversations(path)) == [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]


def test_evaluation_prompts_never_become_training_prompts():
    conversations = [[{"role": "user", "content": "Write a haiku."}], [{"role": "user", "content": "Please solve: " + "x" * 50}],
                     [{"role": "user", "content": "Tell me a joke."}]]
    kept = training_prompts(conversations, limit=10, exclude=["write a  HAIKU.", "x" * 50])
    assert kept == ["Tell me a joke."]


def test_prompts_already_answered_are_left_out_so_a_second_folder_adds_new_ones():
    conversations = [[{"role": "user", "content": c}] for c in ("Say hi.", "Add 2 and 3.", "Name a colour.")]
    assert training_prompts(conversations, limit=10, answered=["say  HI."]) == ["Add 2 and 3.", "Name a colour."]


def test_lora_fine_tuning_trains_adapters_and_selector_and_reloads_the_peft_way(target, records, tmp_path):
    from peft import PeftModel, get_peft_model_state_dict

    from dflash2_hf.training.setup import with_lora

    reference = new_drafter().state_dict()
    wrapped = with_lora(new_drafter(), rank=4)
    frozen = {k: v.clone() for k, v in wrapped.named_parameters() if not v.requires_grad}
    config = TrainingConfig(output_dir=str(tmp_path / "run"), steps=4, batch_size=2, blocks_per_sequence=2,
                            warmup_steps=1, learning_rate=1e-2, checkpoint_every=2)
    run = DrafterTrainer(wrapped, target, records, config)
    run.train()
    run.export(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    assert all(torch.equal(v, dict(wrapped.named_parameters())[k]) for k, v in frozen.items()), "base stays frozen"

    loaded = PeftModel.from_pretrained(new_drafter(), tmp_path / "adapter").eval()
    trained, reloaded = get_peft_model_state_dict(run.unwrapped), get_peft_model_state_dict(loaded)
    assert trained.keys() == reloaded.keys() and any("lora_A" in k for k in trained)
    assert all(torch.equal(trained[k], reloaded[k]) for k in trained)
    selector = loaded.candidate_selector.modules_to_save["default"]
    assert not torch.equal(selector.successor_codebook, reference["candidate_selector.successor_codebook"])
    prompt = torch.tensor([records[0]["prompt_ids"]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=12)
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=12, assistant_model=loaded), expected)


def test_heldout_acceptance_is_recorded_and_plotted(target, records, tmp_path):
    from dflash2_hf.measuring.plots import training_curves

    run = trainer(target, records, tmp_path, steps=5, heldout_fraction=0.25)
    history = run.train()
    assert len(run.heldout) == 3
    for key in ("heldout_acceptance", "heldout_selector_acceptance"):
        assert 1.0 <= history[-1][key] <= run.unwrapped.block_size
    assert training_curves(history, tmp_path / "curves.png").stat().st_size > 1000


def test_heldout_acceptance_goes_through_in_batches_with_the_same_result(target, records, tmp_path):
    run = trainer(target, records, tmp_path, steps=1, heldout_fraction=0.5)
    whole = run.heldout_acceptance()
    run.config.batch_size = 1  # one held-out sequence per forward: the same blocks, the same figure
    assert run.heldout_acceptance() == whole


@pytest.fixture(scope="module")
def memorising_run(target, records, tmp_path_factory):
    """A run whose 4 held-out sequences are also in its training data, trained until it gets some blocks right."""
    run = trainer(target, records + records[:4], tmp_path_factory.mktemp("memorising"), steps=100,
                  heldout_fraction=0.25)
    with one_torch_thread():  # the same float sums, so the same drafter, however loaded the machine is
        run.train()
    assert run.heldout_acceptance()["argmax"] > 1.0
    return run


def test_heldout_selector_walk_is_the_argmax_path_when_the_selector_adds_nothing(memorising_run):
    with torch.no_grad():
        memorising_run.unwrapped.candidate_selector.hidden_projection.weight.zero_()  # scores = the drafter's logits
    acceptance = memorising_run.heldout_acceptance()
    assert acceptance["greedy"] == acceptance["argmax"]


def test_heldout_selector_walk_differs_from_argmax_when_the_pair_term_reranks(memorising_run):
    with torch.no_grad():  # pair terms that swamp the logits
        memorising_run.unwrapped.candidate_selector.hidden_projection.weight.normal_(std=50.0)
    acceptance = memorising_run.heldout_acceptance()
    assert acceptance["greedy"] != acceptance["argmax"]


def test_decoding_visits_the_anchor_after_each_blocks_accepted_tokens():
    assert decoding_anchors([3, 1, 1, 2, 1, 4, 1, 1]) == [0, 3, 5]
    assert decoding_anchors([1, 1, 1]) == [0, 1, 2]


@pytest.fixture(scope="module")
def greedy_memorising_run(target, tmp_path_factory):
    """A run on the target's greedy answers whose 4 held-out answers are also in its training data."""
    records = target_answers(target, seed=1, do_sample=False)
    run = trainer(target, records + records[:4], tmp_path_factory.mktemp("greedy"), steps=100, heldout_fraction=0.25)
    with one_torch_thread():
        run.train()
    return run


# The decoding-anchor measure follows fp32 decoding with the layers' own forward. Decoding packs the linears' weights
# for oneDNN by default, which orders the float32 sums differently on some CPUs (an AVX-512 Zen 4 here): a drafted
# token at a near tie of this tiny drafter can then differ, so these tests decode unpacked, as the measure models.
@pytest.mark.parametrize("path", ["argmax", "greedy"])
def test_decoding_anchor_acceptance_is_what_greedy_decoding_accepts(greedy_memorising_run, target, path, one_thread):
    run = greedy_memorising_run
    drafter, block = run.unwrapped.eval(), run.unwrapped.block_size
    decoded = []
    for record in run.heldout:
        prompt = torch.tensor([record["prompt_ids"]])
        target.generate(prompt, max_new_tokens=len(record["response_ids"]), do_sample=False, assistant_model=drafter,
                        dflash_path=path, dflash_packed_linears=False)
        anchor, last = len(record["prompt_ids"]), len(record["prompt_ids"]) + len(record["response_ids"]) - block
        for length in drafter.last_generation_stats.acceptance_lengths:  # the blocks wholly inside the answer
            if anchor > last:
                break
            decoded.append(length)
            anchor += length
    assert sum(decoded) / len(decoded) > 1.0  # some blocks were partly accepted
    assert run.heldout_decoding_acceptance()[path] == pytest.approx(sum(decoded) / len(decoded))


def test_decoding_anchor_blocks_start_where_greedy_decoding_with_the_argmax_path_drafts(
    greedy_memorising_run, target, tmp_path, one_thread
):
    frozen = copy.deepcopy(greedy_memorising_run.unwrapped)
    run = trainer(target, greedy_memorising_run.records, tmp_path, steps=1, drafter=frozen, train_drafter=False,
                  anchors="decoding", blocks_per_sequence=64)  # room for every anchor an answer visits
    batch, block = run.batch_for_step(0), frozen.block_size
    drafter = copy.deepcopy(frozen).eval()
    for row, record_id in enumerate(batch.record_ids):
        record = run.records[record_id]
        prompt = torch.tensor([record["prompt_ids"]])
        target.generate(prompt, max_new_tokens=len(record["response_ids"]), do_sample=False, assistant_model=drafter,
                        dflash_path="argmax", dflash_packed_linears=False)
        visited, anchor = [], len(record["prompt_ids"])
        last = len(record["prompt_ids"]) + len(record["response_ids"]) - block  # blocks wholly inside the answer
        for length in drafter.last_generation_stats.acceptance_lengths:
            if anchor > last:
                break
            visited.append(anchor)
            anchor += length
        chosen = sorted(a for a in batch.anchors[row].tolist() if a >= 0)
        assert chosen == visited
        assert any(later - earlier > 1 for earlier, later in zip(chosen, chosen[1:])), "some blocks were skipped over"


def test_an_answer_shorter_than_a_block_gets_no_decoding_anchor_blocks(target, records, tmp_path):
    short = [{"prompt_ids": record["prompt_ids"], "response_ids": record["response_ids"][:2]} for record in records]
    run = trainer(target, short, tmp_path, steps=1, train_drafter=False, anchors="decoding")
    batch = run.batch_for_step(0)
    assert (batch.anchors == -1).all() and (batch.labels == IGNORE).all()


def test_heldout_acceptance_of_a_dflash_v1_drafter_has_the_argmax_path_only(target, records, tmp_path):
    run = trainer(target, records, tmp_path, steps=1, heldout_fraction=0.5, drafter=new_drafter("dflash"))
    assert set(run.heldout_acceptance()) == {"argmax"}


@pytest.mark.parametrize("training", [True, False])
def test_heldout_acceptance_leaves_the_drafter_in_the_mode_it_found(target, records, tmp_path, training):
    run = trainer(target, records, tmp_path, steps=1, heldout_fraction=0.5)
    run.drafter.train(training)
    run.heldout_acceptance()
    assert run.drafter.training is training


def test_past_its_budget_the_feature_cache_stops_growing_and_training_is_unchanged(target, records, tmp_path):
    uncached = trainer(target, records, tmp_path / "uncached", steps=3, feature_cache_gb=0.0)
    cached = trainer(target, records, tmp_path / "cached", steps=3)
    losses = [[h["loss"] for h in run.train()] for run in (uncached, cached)]
    assert uncached.feature_cache == {} and cached.feature_cache
    assert losses[0] == losses[1]


def test_initialising_from_the_target_copies_its_top_layers_and_final_norm(target):
    from dflash2_hf.training.setup import initialize_from_target

    config = tiny_drafter_config("dflash2", intermediate_size=128)
    drafter = DFlashDraftModel.class_for_config(config)(config)
    copied = initialize_from_target(drafter, target)
    layers = target.get_decoder().layers
    torch.testing.assert_close(drafter.layers[1].mlp.down_proj.weight, layers[-1].mlp.down_proj.weight)
    torch.testing.assert_close(drafter.layers[0].self_attn.q_proj.weight, layers[-2].self_attn.q_proj.weight)
    torch.testing.assert_close(drafter.norm.weight, target.get_decoder().norm.weight)
    features = torch.randn(3, 2 * 64)
    torch.testing.assert_close(drafter.fc(features), features[:, 64:])
    assert "layers.1.self_attn.k_norm.weight" in copied and "fc.weight" in copied


def test_export_records_budget_and_provenance_for_the_model_card(target, records, tmp_path):
    run = trainer(target, records, tmp_path / "run", steps=2)
    run.train()
    run.export(tmp_path / "drafter", provenance={"target": "org/target", "data": "12 responses"})
    record = json.loads((tmp_path / "drafter" / "training.json").read_text())
    assert (record["target"], record["data"]) == ("org/target", "12 responses")
    assert record["budget"]["steps"] == 2 and record["budget"]["cpu_seconds"] > 0
    assert DFlashDraftModel.from_pretrained(tmp_path / "drafter").dtype == torch.bfloat16


@pytest.mark.parametrize("manifest", ['{"target": "tiny"}', "{cut", "[]", '{"do_sample": true}'])
def test_a_manifest_that_does_not_say_how_the_data_was_made_is_described_as_such(tmp_path, manifest):
    from dflash2_hf.training.data import describe_data

    (tmp_path / "manifest.json").write_text(manifest)
    assert describe_data(tmp_path, 4) == "4 responses (its manifest.json does not say how they were made)"


def test_data_description_comes_from_the_manifest(tmp_path):
    from dflash2_hf.training.data import describe_data

    (tmp_path / "manifest.json").write_text(json.dumps(
        {"target": "t", "max_new_tokens": 64, "do_sample": True, "temperature": 0.7, "prompts_sha256": "x"}))
    assert describe_data(tmp_path, 5).startswith("5 responses written by the target itself (sampled at temperature 0.7, up to 64")


def test_continuing_a_trained_drafter_starts_from_its_weights(tmp_path):
    from dflash2_hf.training.setup import drafter_to_continue

    saved = tiny_drafter(seed=3)
    saved.save_pretrained(tmp_path)
    continued = drafter_to_continue(tmp_path, selector_rank=8)
    assert continued.config.selector_rank == saved.config.selector_rank
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), continued.state_dict().values()))


def test_a_dflash_v1_drafter_upgrades_to_dflash2_and_drafts_exactly_as_before(tmp_path):
    from dflash2_hf.training.setup import drafter_to_continue

    v1 = tiny_drafter("dflash", seed=3).eval()
    v1.save_pretrained(tmp_path)
    upgraded = drafter_to_continue(tmp_path, selector_rank=8).eval()
    assert upgraded.config.is_dflash2 and upgraded.candidate_selector is not None
    embeds, context = torch.randn(1, 4, 64), torch.randn(1, 5, 64 * len(v1.target_layer_ids))
    positions = torch.arange(9)[None]
    with torch.no_grad():
        before = v1(embeds, context_hidden_states=context, position_ids=positions).last_hidden_state
        after = upgraded(embeds, context_hidden_states=context, position_ids=positions).last_hidden_state
    torch.testing.assert_close(after, before)


def test_training_refuses_a_drafter_that_does_not_fit_the_target(target, records, tmp_path):
    wrong = DFlashDraftModel(tiny_drafter_config(num_target_layers=7, target_layer_ids=[1, 6]))
    with pytest.raises(ValueError, match="does not fit the target"):
        DrafterTrainer(wrong, target, records, TrainingConfig(output_dir=str(tmp_path)))
