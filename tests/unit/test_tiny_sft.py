"""SFT warm start: answer-only labels in verl's chat format, a loss that falls, a loadable result."""
from __future__ import annotations

import json

import torch

from qurl_recipes.tiny_model import build_tiny_model
from qurl_recipes.tiny_sft import SftSettings, _encode, run_sft, sampled_accuracy


def test_labels_cover_only_answer_and_end_of_turn(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m"))
    ids, labels = _encode(tok, "What is 3 + 4? Answer with a number.", "7")
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4? Answer with a number."}],
                                     add_generation_prompt=True, tokenize=False)
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert labels[:n_prompt] == [-100] * n_prompt
    assert labels[n_prompt:] == ids[n_prompt:]
    assert tok.decode(ids) == prompt + "7<|im_end|>"  # exactly what verl's rollout would see, then the answer


def test_short_sft_lowers_loss_and_saves_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = build_tiny_model(tmp_path / "base")
    settings = SftSettings(steps=40, batch_size=16, warmup_steps=5, eval_prompts=8)
    record = run_sft(base, tmp_path / "sft", settings, log_every=0)
    assert record["loss_last_50"] < 0.6 * record["loss_first"]
    saved = json.loads((tmp_path / "sft" / "qurl_tiny_sft.json").read_text())
    assert saved["settings"]["steps"] == 40 and 0.0 <= saved["greedy_acc"] <= 1.0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sft", dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    assert AutoTokenizer.from_pretrained(tmp_path / "sft").eos_token == "<|im_end|>"


def test_sampled_accuracy_counts_correct_greedy_answers(tmp_path):
    """A model trained on one fixed question answers it; the metric must say so, and reject wrong keys."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = build_tiny_model(tmp_path / "base")
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    q = "What is 3 + 4? Answer with a number."
    ids, labels = _encode(tok, q, "7")
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x, y = torch.tensor([ids]), torch.tensor([labels])
    for _ in range(60):
        opt.zero_grad()
        model(input_ids=x, labels=y).loss.backward()
        opt.step()
    model.eval()
    assert sampled_accuracy(model, tok, [(q, "7")], temperature=0.0)["acc_mean"] == 1.0
    assert sampled_accuracy(model, tok, [(q, "8")], temperature=0.0)["acc_mean"] == 0.0


def test_chain_task_labels_cover_the_solution_and_its_answer_is_graded(tmp_path):
    """Chain task: the loss covers the whole written-out solution, and the metric reads "Answer: N"."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qurl_recipes.data.chain_arithmetic import sft_pairs

    base = build_tiny_model(tmp_path / "base")
    tok = AutoTokenizer.from_pretrained(base)
    q, solution = next(sft_pairs(seed=5, min_ops=3, max_ops=3))  # short enough to memorise in a few steps
    ids, labels = _encode(tok, q, solution)
    prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert labels[:n_prompt] == [-100] * n_prompt and labels[n_prompt:] == ids[n_prompt:]
    assert tok.decode(ids[n_prompt:]) == solution + "<|im_end|>"
    answer = solution.rsplit("Answer: ", 1)[1]

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x, y = torch.tensor([ids]), torch.tensor([labels])
    for _ in range(120):
        opt.zero_grad()
        model(input_ids=x, labels=y).loss.backward()
        opt.step()
    model.eval()
    chain = dict(temperature=0.0, task="chain_arithmetic")
    assert sampled_accuracy(model, tok, [(q, answer)], **chain)["acc_mean"] == 1.0
    assert sampled_accuracy(model, tok, [(q, str(int(answer) + 1))], **chain)["acc_mean"] == 0.0


def test_chain_task_sft_runs_and_records_the_task(tmp_path):
    base = build_tiny_model(tmp_path / "base")
    settings = SftSettings(task="chain_arithmetic", min_ops=2, max_ops=3, steps=4, batch_size=4, warmup_steps=2,
                           eval_prompts=1)
    record = run_sft(base, tmp_path / "sft", settings, log_every=0)
    assert record["settings"]["task"] == "chain_arithmetic" and 0.0 <= record["greedy_acc"] <= 1.0
    assert record["loss_last_50"] < record["loss_first"]
