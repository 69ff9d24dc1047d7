"""speculators 0.9.0 itself, run by tests/test_speculators_peer.py under the speculators venv (it needs
transformers <= 5.19, so it cannot share this package's venv). It imports nothing of dflash2_hf.

    python speculators_worker.py build KIND VERIFIER OUT [--aux-ids 1 2 4] [--block-size 8] [--seed 0]
        [--draft-vocab-size N]
    python speculators_worker.py forward DRAFTER VERIFIER REQUEST.json OUT.safetensors
    python speculators_worker.py state DRAFTER OUT.safetensors
    python speculators_worker.py convert ZLAB_FOLDER VERIFIER OUT

``build`` makes a drafter with speculators' own classes for the verifier's shape (every weight random, so no
convolution is the identity; with ``--draft-vocab-size``, the tokens speculators' own vocabulary mapping picks
from random token counts, and a random head of its own over them) and saves it with speculators' ``save_pretrained``. ``forward`` loads a drafter with
speculators' ``from_pretrained`` and runs its own block forward (``_backbone_forward``, what its trainer runs) at
each anchor of a sequence, on the verifier's hidden states taken by speculators' convention (aux id ``k`` is
``hidden_states[k]``); it saves the drafter's hidden states and logits of every block slot and, for DFlash 2, the
selector's scores of the top-K candidates after each slot's true predecessor. ``state`` saves the drafter's tensors as
speculators loaded them; ``convert`` runs speculators' converter of z-lab DFlash checkpoints.
"""

import argparse
import json

import torch
from safetensors.torch import save_file
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.convert.dflash import DFlashConverter
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

MODELS = {"dflash": (DFlashDraftModel, DFlashSpeculatorConfig), "dflash2": (DFlash2DraftModel, DFlash2SpeculatorConfig)}


def layer_config(verifier: str, layers: int) -> Qwen3Config:
    """The draft transformer's config as speculators' trainer makes it: the verifier's, with the drafter's layers."""
    fields = AutoConfig.from_pretrained(verifier).to_dict()
    fields.pop("layer_types", None)
    config = Qwen3Config(**{**fields, "num_hidden_layers": layers})
    config._attn_implementation = "eager"
    return config


def build(args: argparse.Namespace) -> None:
    model_class, config_class = MODELS[args.kind]
    layers = layer_config(args.verifier, layers=2)
    extra = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4) if args.kind == "dflash2" else {}
    proposal = GreedyTokenProposalConfig(speculative_tokens=args.block_size - 1)
    verifier = VerifierConfig(name_or_path=args.verifier, architectures=list(AutoConfig.from_pretrained(args.verifier).architectures))
    draft_vocab_size = args.draft_vocab_size or layers.vocab_size
    config = config_class(
        transformer_layer_config=layers, draft_vocab_size=draft_vocab_size, block_size=args.block_size,
        aux_hidden_state_layer_ids=args.aux_ids, mask_token_id=layers.vocab_size - 1,
        speculators_config=SpeculatorsConfig(algorithm=args.kind, proposal_methods=[proposal],
                                             default_proposal_method="greedy", verifier=verifier),
        **extra,
    )
    model = model_class(config)
    generator = torch.Generator().manual_seed(args.seed)
    verifier_owned = ["embed_tokens.weight", "verifier_lm_head.weight"]
    if draft_vocab_size == layers.vocab_size:
        verifier_owned.append("lm_head.weight")  # a draft vocabulary's head is the drafter's own: random here
    else:
        counts = torch.randint(1, 1000, (layers.vocab_size,), generator=generator).tolist()  # token frequencies
        d2t, t2d = build_vocab_mappings_from_distribution(dict(enumerate(counts)), draft_vocab_size, layers.vocab_size)
        model.load_vocab_mappings(t2d, d2t)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and name not in verifier_owned:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
    model.save_pretrained(args.out)


def kind_of(drafter: str) -> str:
    """The ``speculators_model_type`` of a saved drafter folder."""
    with open(f"{drafter}/config.json") as file:
        return json.load(file)["speculators_model_type"]


def load(drafter: str, verifier_model) -> torch.nn.Module:
    """A drafter loaded by speculators, with the verifier-owned weights taken from the verifier (as
    ``load_verifier_weights`` does from the Hub), in eager attention (no torch.compile on a CPU)."""
    model_class = MODELS[kind_of(drafter)][0]
    config = model_class.config_class.from_pretrained(drafter)
    config.transformer_layer_config._attn_implementation = "eager"
    model = model_class.from_pretrained(drafter, config=config).eval()
    head = verifier_model.get_output_embeddings().weight
    if model.use_draft_vocab:  # the drafter's own head over its draft vocabulary stays as loaded
        head = head[model.t2d]
    else:
        with torch.no_grad():
            model.lm_head.weight.copy_(head)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(verifier_model.get_input_embeddings().weight)
        model.verifier_lm_head.weight.copy_(head)
        model.verifier_norm.weight.copy_(verifier_model.model.norm.weight)
    return model


@torch.no_grad()
def forward(args: argparse.Namespace) -> None:
    request = json.loads(open(args.request).read())
    verifier = AutoModelForCausalLM.from_pretrained(args.verifier, dtype=torch.float32).eval()
    model = load(args.drafter, verifier)
    block = model.block_size
    sequence = torch.tensor([request["sequence"] + [0] * (block + 1)])  # room after the last anchor's block
    states = verifier(sequence, output_hidden_states=True).hidden_states
    features = torch.cat([states[k] for k in model.config.aux_hidden_state_layer_ids], dim=-1)
    results = {}
    for row, anchor in enumerate(request["anchors"]):
        loss_mask = torch.zeros_like(sequence)
        loss_mask[0, anchor] = 1  # the only valid anchor: select_anchors picks it
        hidden, logits, _, _, indices = model._backbone_forward(
            features, sequence, loss_mask, states[-1], torch.zeros_like(sequence), max_anchors=1)
        results[f"hidden.{row}"], results[f"logits.{row}"] = hidden[0], logits[0]
        if hasattr(model, "candidate_selector"):
            predecessors = model._predecessor_ids(sequence, indices).reshape(1, -1)
            candidates = logits.topk(model.candidate_selector.top_k, dim=-1).indices
            results[f"candidates.{row}"] = candidates[0]
            results[f"scores.{row}"] = model.candidate_selector.score_candidates(logits, hidden, predecessors, candidates)[0]
    save_file({name: tensor.contiguous() for name, tensor in results.items()}, args.out)


def state(args: argparse.Namespace) -> None:
    model_class = MODELS[kind_of(args.drafter)][0]
    model = model_class.from_pretrained(args.drafter)
    owned = ("embed_tokens.", "verifier_lm_head.", "verifier_norm.", "t2d")
    if not model.use_draft_vocab:  # a draft vocabulary's head and offsets are the drafter's own
        owned += ("lm_head.", "d2t")
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()
               if not name.startswith(owned)}, args.out)
    print(json.dumps({"class": type(model).__name__, "speculators_model_type": model.config.speculators_model_type}))


def convert(args: argparse.Namespace) -> None:
    DFlashConverter().convert(args.folder, args.out, base_model=args.verifier, validate=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("build")
    command.add_argument("kind", choices=MODELS)
    command.add_argument("verifier")
    command.add_argument("out")
    command.add_argument("--aux-ids", type=int, nargs="+", default=[1, 3])
    command.add_argument("--block-size", type=int, default=8)
    command.add_argument("--seed", type=int, default=0)
    command.add_argument("--draft-vocab-size", type=int, help="draft from this many random target tokens (dflash)")
    command.set_defaults(run=build)
    command = commands.add_parser("forward")
    for name in ("drafter", "verifier", "request", "out"):
        command.add_argument(name)
    command.set_defaults(run=forward)
    command = commands.add_parser("state")
    command.add_argument("drafter")
    command.add_argument("out")
    command.set_defaults(run=state)
    command = commands.add_parser("convert")
    for name in ("folder", "verifier", "out"):
        command.add_argument(name)
    command.set_defaults(run=convert)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
