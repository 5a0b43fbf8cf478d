"""`llamajet chat` driven through a pseudo-terminal, as a person types:
a message, Ctrl-C in the middle of the reply (the reply stops, the session
and the conversation stay), the next message answered with the earlier turns
kept, a line recalled with the up arrow, /history, /clear, and Ctrl-C twice
at an empty prompt to leave. The default model, greedy."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import sys
import time

import pytest

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|\r")


class Term:
    def __init__(self, *args: str) -> None:
        env = {**os.environ, "TERM": "xterm", "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "LINES": "50"}
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the chat on the pty's slave side, its controlling terminal
            # as from a person's shell: SIGINT not ignored (a shell's background job, like this test run
            # under CI, would pass "ignored" on, and Python keeps it so)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, [])  # nor blocked (a mask is inherited across exec)
            os.execve(sys.executable, [sys.executable, "-m", "llamajet.cli", "chat", *args], env)
        self.out = ""

    def read_until(self, pattern: str, timeout: float = 120.0) -> str:
        """Reads until `pattern` (a regex) appears in the output since the last match; returns that output."""
        deadline = time.time() + timeout
        rx = re.compile(pattern)
        while True:
            text = ANSI.sub("", self.out)
            m = rx.search(text)
            if m:
                self.out = text[m.end():]
                return text[:m.end()]
            left = deadline - time.time()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} in {text[-2000:]!r}")
            r, _, _ = select.select([self.fd], [], [], min(left, 0.5))
            if r:
                try:
                    self.out += os.read(self.fd, 65536).decode("utf-8", "replace")
                except OSError:  # the child closed the terminal
                    raise AssertionError(f"the chat ended; no {pattern!r} in {text[-2000:]!r}") from None

    def send(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.time() + timeout
        while time.time() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:  # keep the pty drained
                if select.select([self.fd], [], [], 0.1)[0]:
                    self.out += os.read(self.fd, 65536).decode("utf-8", "replace")
            except OSError:
                pass
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError("the chat did not exit")

    def close(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


PROMPT = r"\n> $"


def test_ctrl_c_stops_the_reply_and_keeps_the_conversation(smollm2_gguf):
    t = Term("--temperature", "0", "--max-tokens", "2000", "--system", "You are a helpful assistant.")
    try:
        t.read_until(r"/help lists commands.*\n> $")
        t.send("Count from 1 to 400, one number per line.\r")
        # greedy, this reply counts "1. 1" ... "40. 40" (~200 tokens, over a second here): stopped early in it
        t.read_until(r"\n2\. 2\n")
        t.send("\x03")  # Ctrl-C: the terminal sends SIGINT to the chat
        seen = t.read_until(r"\[interrupted\]" + PROMPT)
        assert "Traceback" not in seen and "KeyboardInterrupt" not in seen
        t.send("Name the capital of France.\r")
        reply = t.read_until(PROMPT)
        assert "Paris" in reply, reply
        t.send("/history\r")
        hist = t.read_until(PROMPT)
        turns = re.findall(r"^\[(system|user|assistant)\] ", hist, flags=re.M)
        assert turns == ["system", "user", "assistant", "user", "assistant"], hist
        assert "[user] Count from 1 to 400" in hist and "[user] Name the capital of France." in hist
        first_reply = hist.split("[assistant] ", 1)[1].split("[user]", 1)[0]
        assert "2. 2" in first_reply and "40. 40" not in first_reply  # the stopped reply, as far as it got
        # the up arrow recalls the previous line (/history), twice the one before it
        t.send("\x1b[A\x1b[A\r")
        again = t.read_until(PROMPT)
        assert "Paris" in again, again
        t.send("/history\r")
        hist = t.read_until(PROMPT)
        assert hist.count("[user] Name the capital of France.") == 2, hist
        t.send("/clear\r")
        t.read_until(r"conversation cleared\)" + PROMPT)
        t.send("/history\r")
        hist = t.read_until(PROMPT)
        assert re.findall(r"^\[(\w+)\] ", hist, flags=re.M) == ["system"], hist  # --system stays
        t.send("/nope\r")
        t.read_until(r"unknown command /nope: /help lists them" + PROMPT)
        # Ctrl-C at the prompt: sent a moment after the prompt shows, as a person would. (Python's readline
        # writes the prompt, then waits in select(); a SIGINT landing between the two is seen only at the
        # next key, a race of readline's, not of the chat's.)
        time.sleep(0.3)
        t.send("\x03")
        t.read_until(r"Ctrl-C again, Ctrl-D or /exit to quit\)" + PROMPT)
        time.sleep(0.3)
        t.send("\x03")
        assert t.wait() == 0
    finally:
        t.close()


def test_a_reply_cut_at_max_tokens_says_so_and_help_and_exit(smollm2_gguf):
    t = Term("--temperature", "0", "--max-tokens", "5")
    try:
        t.read_until(PROMPT)
        t.send("Tell me a long story about a dragon.\r")
        t.read_until(r"\[cut at --max-tokens 5\]" + PROMPT)
        t.send("/help\r")
        h = t.read_until(PROMPT)
        for cmd in ("/clear", "/history", "/help", "/exit", "Ctrl-C"):
            assert cmd in h
        t.send("/exit\r")
        assert t.wait() == 0
    finally:
        t.close()
