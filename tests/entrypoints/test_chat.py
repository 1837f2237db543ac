"""``fastllm chat`` through a pseudo-terminal (pexpect), as a user types: each reply is the one
``LLM.chat`` gives the whole conversation so far (greedy, batch-invariant, the same tiny random
Qwen3 with the real Qwen3 chat template); /clear, /exit, end of input, unknown commands, Ctrl-C
at the prompt and Ctrl-C during a reply (which stops the reply, keeps it in the conversation and
keeps the program)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pexpect
import pytest
from tiny_hf import tiny_qwen3_folder

from fastllm import LLM, SamplingParams
from fastllm.entrypoints.cli import main

PROMPT = ">>> "


@pytest.fixture(scope="module")
def qwen3(model_path, tmp_path_factory) -> Path:
    return tiny_qwen3_folder(tmp_path_factory.mktemp("qwen3"), model_path("qwen3_tokenizer"),
                             seed=0)


@pytest.fixture(scope="module")
def reference(qwen3) -> LLM:
    return LLM(qwen3, batch_invariant=True)


def spawn(folder: Path, *options: str) -> pexpect.spawn:
    """``fastllm chat folder`` (greedy, batch-invariant) on a pseudo-terminal, at its first
    prompt."""
    # TERM=dumb: readline writes no escape sequences around what it echoes. SIGINT at its
    # default, as a terminal's shell starts a program: pytest started in the background of a
    # script inherits it ignored, and an ignored SIGINT stays ignored across exec.
    chat = pexpect.spawn(sys.executable, ["-m", "fastllm", "chat", str(folder), "--temperature",
                                          "0", "--batch-invariant", *options],
                         env={**os.environ, "TERM": "dumb"}, encoding="utf-8", timeout=60,
                         dimensions=(24, 500),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    chat.expect_exact(PROMPT)
    return chat


def send(chat: pexpect.spawn, line: str) -> None:
    chat.sendline(line)
    chat.expect_exact(line + "\r\n")  # the terminal's echo


def answer(chat: pexpect.spawn, line: str) -> str:
    """What the program writes for ``line`` up to its next prompt, with the terminal's line
    ends turned back into "\\n"."""
    send(chat, line)
    chat.expect_exact(PROMPT)
    return chat.before.replace("\r\n", "\n")


def expected(reference: LLM, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, str]:
    """LLM.chat's greedy reply to ``messages`` and its finish reason."""
    output = reference.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens),
                            use_tqdm=False)[0].outputs[0]
    return output.text, output.finish_reason


def shown(reply: str, finish_reason: str, max_tokens: int) -> str:
    """How the chat shows a reply: its text, a line end, and a note when --max-tokens cut it."""
    return reply + "\n" + (f"[cut at --max-tokens {max_tokens}]\n"
                           if finish_reason == "length" else "")


def test_a_conversation_is_the_chat_of_all_its_turns(qwen3, reference):
    chat = spawn(qwen3, "--system-prompt", "You are terse.", "--max-tokens", "12")
    assert "/exit" in chat.before and "/clear" in chat.before  # the banner says how
    messages = [{"role": "system", "content": "You are terse."}]
    screens = []
    for line in ("Hi there", "Tell me more"):
        messages.append({"role": "user", "content": line})
        reply, finish_reason = expected(reference, messages, 12)
        screens.append(answer(chat, line))
        assert screens[-1] == shown(reply, finish_reason, 12)
        messages.append({"role": "assistant", "content": reply})
    assert answer(chat, "") == ""  # an empty line does nothing
    # /clear starts over from the system prompt: the first reply again.
    assert answer(chat, "/clear") == "Cleared the conversation.\n"
    assert answer(chat, "Hi there") == screens[0]
    send(chat, "/exit")
    chat.expect(pexpect.EOF)
    chat.wait()
    assert chat.exitstatus == 0


def threads_and_signals(pid: int) -> list[str]:
    """Each thread of process ``pid``: its name, where it waits, and its pending, blocked,
    ignored and caught signals (what tells which thread a SIGINT went to, if any)."""
    found = []
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        status = dict(line.split(":\t", 1) for line in
                      (task / "status").read_text().splitlines() if ":\t" in line)
        found.append(" ".join([status["Name"], (task / "wchan").read_text()]
                              + [f"{key}={status[key]}" for key in ("SigPnd", "ShdPnd",
                                                                    "SigBlk", "SigIgn",
                                                                    "SigCgt")]))
    return found


def test_ctrl_c_stops_a_reply_and_keeps_the_program(qwen3, reference):
    chat = spawn(qwen3, "--max-tokens", "120")
    # At the prompt, Ctrl-C only says how to exit. CPython's readline notices a SIGINT when it
    # interrupts its wait for input: one that lands after the prompt is written but before
    # that wait starts (a busy machine) is handled at the next one, so the key is pressed
    # again until the answer comes.
    for _ in range(3):
        chat.sendintr()
        if chat.expect_exact(["Use Ctrl + d or /bye to exit.\r\n" + PROMPT, pexpect.TIMEOUT],
                             timeout=10) == 0:
            break
    else:
        raise AssertionError(f"Ctrl-C at the prompt got no answer: {chat.before!r}; the "
                             f"program's threads: {threads_and_signals(chat.pid)}")
    assert "Unknown command '/what'." in answer(chat, "/what")

    # This model's replies run to --max-tokens; Ctrl-C once the reply shows.
    full, finish_reason = expected(reference, [{"role": "user", "content": "Hi"}], 120)
    assert finish_reason == "length"
    send(chat, "Hi")
    chat.expect(r"\S")
    started = chat.before + chat.after
    chat.sendintr()
    chat.expect_exact(PROMPT)
    # The terminal echoed ^C where the reply stood when the key was pressed.
    partial = (started + chat.before).replace("^C", "").replace("\r\n", "\n")
    assert partial.endswith("\n")
    partial = partial[:-1]
    assert partial and full.startswith(partial) and len(partial) < len(full)

    # The stopped reply stays in the conversation: the next reply continues from it.
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": partial},
                {"role": "user", "content": "Go on"}]
    reply, finish_reason = expected(reference, messages, 120)
    assert answer(chat, "Go on") == shown(reply, finish_reason, 120)
    chat.sendeof()
    chat.expect(pexpect.EOF)
    chat.wait()
    assert chat.exitstatus == 0


def test_a_model_without_a_chat_template_is_refused(model_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["chat", str(model_path("stories260K_hf"))])
    assert exit_info.value.code == 2
    assert "has no chat template: fastllm chat needs one" in capsys.readouterr().err
