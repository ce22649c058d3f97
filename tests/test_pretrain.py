"""Base pretraining of a from-scratch policy: the corpus stream, the packing, the training loop, the guard."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from rollout.agent import DEFAULT_SYSTEM_PROMPT, DONE_MARKER
from sandbox.tasks.families import FAMILIES, generate
from sandbox.tasks.families.chain import END, step_command
from sandbox.tasks.families.finish import CLEANUP, DEMO_COMPLETE_RATE, SCRATCH_DIR
from t1core.config_toml import load_config
from t1model.model import ModelConfig, MoEModel
from sandbox.tasks.suite import SEED_STRIDE
from t1core.pretrain import PretrainConfig, corpus_families, corpus_texts, packed_rows, pretrain, pretrains
from t1model.tokenizer import ChatTokenizer, format_tool_call

FAMS = ["create_file", "count_lines"]


def test_corpus_is_deterministic_alternates_families_and_skips_avoided_instructions() -> None:
    first = list(itertools.islice(corpus_texts(FAMS, seed_block=2), 6))
    assert first == list(itertools.islice(corpus_texts(FAMS, seed_block=2), 6))
    spec = generate("count_lines", 2 * SEED_STRIDE, "train")  # the second text of the stream
    demo = spec.demonstration if spec.demonstration is not None else spec.turns  # what SFT is shown
    assert first[1] == f"{spec.instruction.strip()}\n{format_tool_call(demo[0].strip())}\n"
    assert first[0].startswith("Create the file") and first[1].startswith(spec.instruction.strip()[:10])
    skipped = list(itertools.islice(corpus_texts(FAMS, seed_block=2, avoid={spec.instruction.strip()}), 5))
    assert skipped == [first[0]] + first[2:6]
    assert list(itertools.islice(corpus_texts(FAMS, seed_block=3), 1)) != first[:1]
    with pytest.raises(ValueError, match="family names"):
        next(corpus_texts(["no_such_family"], seed_block=2))


def test_a_long_familys_corpus_adds_the_short_families_that_teach_the_copy() -> None:
    short = list(FAMILIES)
    assert corpus_families([]) == short
    assert corpus_families(["create_file", "sort_file"]) == ["create_file", "sort_file"]
    assert corpus_families(["follow_chain"]) == ["follow_chain", *short]
    assert corpus_families(["sort_file", "follow_chain"]) == ["sort_file", "follow_chain",
                                                              *[f for f in short if f != "sort_file"]]


def test_corpus_does_the_finishing_step_as_often_as_the_demonstrations() -> None:
    texts = list(itertools.islice(corpus_texts(FAMS, seed_block=2), 400))
    done = sum(f"; {CLEANUP}" in t for t in texts) / len(texts)
    assert all(f"Then remove the directory {SCRATCH_DIR}." in t for t in texts)
    assert abs(done - DEMO_COMPLETE_RATE) < 0.08, done


def test_a_long_familys_document_is_a_whole_walk_in_the_agents_own_tokens() -> None:
    """A follow_chain document is a fresh chain walked to its end: each command copies the output before it, the done
    marker follows `end`, and its ids are those of the contexts the agent builds (prompt, reply, tool response)."""
    tok = ChatTokenizer.builtin()
    texts = list(itertools.islice(corpus_texts(["follow_chain"], seed_block=2), 40))
    assert len(set(texts)) == 40
    for text in texts[:8]:
        instruction = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        first = re.search(r"starting at (q/\w+):", instruction).group(1)
        commands = re.findall(r'"command": "(tee[^"]+)"', text)
        outputs = re.findall(r"<tool_response>\n(\S+)\n\n</tool_response>", text)
        assert len(commands) == len(outputs) and 2 <= len(commands) <= 20 and outputs[-1] == END
        assert commands == [step_command(n) for n in [first, *outputs[:-1]]]
        ids = tok.encode_prompt(DEFAULT_SYSTEM_PROMPT, instruction)
        for command, output in zip(commands, outputs):
            ids += tok.encode(format_tool_call(command)) + tok.assistant_turn_end_ids()
            ids += tok.encode_tool_response(f"{output}\n")
        ids += tok.encode(DONE_MARKER) + tok.assistant_turn_end_ids()
        assert tok.encode(text) == ids
    avoided = texts[0].split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    assert texts[0] not in itertools.islice(corpus_texts(["follow_chain"], seed_block=2, avoid={avoided}), 40)


def test_packed_rows_hold_whole_documents_with_in_document_targets() -> None:
    tok = ChatTokenizer.builtin()
    texts = list(itertools.islice(corpus_texts(FAMS, seed_block=2), 40))
    rows = packed_rows(iter(texts), tok, row_tokens=300)
    docs = []
    for _ in range(3):
        ids_T, targets_T, cu = next(rows)
        assert ids_T.numel() <= 300 and cu[0] == 0 and cu[-1] == ids_T.numel()
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            doc = ids_T[a:b]
            docs.append(tok.decode(doc.tolist()))
            assert torch.equal(targets_T[a:b - 1], doc[1:]) and targets_T[b - 1] == -100
    assert docs == texts[:len(docs)]  # in order, none split or dropped at a row boundary
    with pytest.raises(ValueError, match="exceeds row_tokens"):
        next(packed_rows(iter(texts), tok, row_tokens=10))


def _pretrained(steps: int) -> tuple[MoEModel, dict[str, float]]:
    tok = ChatTokenizer.builtin()
    cfg = ModelConfig.tiny().replace(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                     moe_intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                     head_dim=32, num_experts=4)
    model = MoEModel(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    config = PretrainConfig(families=FAMS, steps=steps, row_tokens=512, seed_block=2, grad_clip=1.0)
    metrics = pretrain(model, tok, config, opt=opt, sched=None)
    return model, metrics


@pytest.mark.slow
def test_pretraining_lowers_the_loss_and_is_bitwise_reproducible() -> None:
    a, metrics = _pretrained(60)
    assert metrics["pretrain/steps"] == 60 and metrics["pretrain/tokens"] > 60 * 400
    assert metrics["pretrain/loss_last"] < 0.6 * metrics["pretrain/loss_first"]
    b, _ = _pretrained(60)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_from_scratch_model_on_a_task_directory_must_opt_out_of_pretraining(tmp_path) -> None:
    cfg = load_config(None, [f"--tasks.source={tmp_path}"])
    with pytest.raises(ValueError, match="warmstart.pretrain_steps=0"):
        pretrains(cfg)
    assert not pretrains(load_config(None, [f"--tasks.source={tmp_path}", "--warmstart.pretrain_steps=0"]))
    assert pretrains(load_config(None, []))
    with pytest.raises(ValueError, match="warmstart.pretrain_seed_block"):
        load_config(None, ["--warmstart.pretrain_seed_block=1"])  # the RL instances' block
