"""t1cli.experiments.copy_probe: its KV-cache greedy decoding against a full-forward loop, and its CLI errors."""

from __future__ import annotations

import pytest
import torch

from t1cli.experiments import copy_probe
from t1model.model import ModelConfig, MoEModel
from t1model.tokenizer import ChatTokenizer


def test_greedy_command_equals_a_full_forward_loop() -> None:
    model = MoEModel(ModelConfig.tiny().replace(num_hidden_layers=2), seed=3).eval()
    tok = ChatTokenizer.builtin()
    instruction = "Create the file /app/list_t64.txt containing the word eagle."
    got = copy_probe.greedy_command(model, tok, instruction, max_new_tokens=6)
    ids = tok.encode(instruction + "\n")
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model.compute_logits(torch.tensor(ids))[-1].argmax()))
    want = tok.decode(ids[len(tok.encode(instruction + "\n")):])
    assert got == want


def test_probe_counts_the_reference_as_exact(monkeypatch) -> None:
    """A model that writes the reference command scores N/N; one that writes anything else scores 0."""
    tok = ChatTokenizer.builtin()
    monkeypatch.setattr(copy_probe, "greedy_command",
                        lambda model, tok, instruction, max_new_tokens: wanted[instruction])
    from sandbox.tasks.families import generate
    from t1model.tokenizer import format_tool_call

    wanted = {generate("create_file", i, "heldout").instruction.strip():
              format_tool_call(generate("create_file", i, "heldout").solution.strip()) for i in range(3)}
    res = copy_probe.probe(None, tok, families=["create_file"], per_family=3)
    assert res["create_file"][0] == 3 and not res["create_file"][1]
    wanted = {k: v.replace("echo", "printf") for k, v in wanted.items()}
    res = copy_probe.probe(None, tok, families=["create_file"], per_family=3)
    assert res["create_file"][0] == 0 and len(res["create_file"][1]) == 3


class _Oracle:
    """A 'model' whose greedy token is the walk's own next token (hidden state = one-hot of it, identity head),
    except where `wrong` says: position -> token it writes instead."""

    def __init__(self, vocab: int, wrong: dict[int, int]) -> None:
        self.lm_head, self.vocab, self.wrong = torch.nn.Identity(), vocab, wrong

    def new_kv_cache(self, **_):
        return None

    def extend(self, ids, **_):
        nxt = [*ids.tolist()[1:], 0]
        for pos, token in self.wrong.items():
            nxt[pos] = token
        return torch.nn.functional.one_hot(torch.tensor(nxt), self.vocab).float(), None


def test_walk_probe_counts_each_call_right_only_when_all_its_tokens_are() -> None:
    """The oracle gets every call of 3 walks right; one wrong digit in the second call of the first walk costs
    exactly that call, and the miss names what it wrote. The done marker is not a call."""
    import random
    import re

    from t1core.pretrain import WALKS, walk_text

    tok = ChatTokenizer.builtin()
    walks = [WALKS["follow_chain"](random.Random(f"follow_chain:probe:{w}")) for w in range(3)]
    calls = sum(len(steps) for _, steps in walks)
    assert copy_probe.walk_probe(_Oracle(tok.vocab_size, {}), tok, "follow_chain", walks=3) == (calls, calls, "")
    ids = tok.encode(walk_text(*walks[0]))
    second = [m.start() for m in re.finditer("tee -a done", tok.decode(ids))][1]
    pos = next(i for i in range(len(ids)) if len(tok.decode(ids[:i + 1])) > second + len("tee -a done < q/") + 1)
    digit = tok.encode("7")[0] if tok.decode([ids[pos]]) != "7" else tok.encode("8")[0]
    right, total, miss = copy_probe.walk_probe(_Oracle(tok.vocab_size, {pos - 1: digit}), tok, "follow_chain", walks=1)
    assert (right, total) == (len(walks[0][1]) - 1, len(walks[0][1])) and tok.decode([digit]) in miss.split("->")[1]


def test_bad_arguments_are_usage_errors(capsys) -> None:
    with pytest.raises(SystemExit):
        copy_probe.main(["/nonexistent", "--families", "create_file,nope"])
    assert "--families: unknown ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        copy_probe.main(["/nonexistent", "--per-family", "0"])
    assert "--per-family must be >= 1" in capsys.readouterr().err
