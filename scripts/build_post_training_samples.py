"""Writes the small chat and preference datasets that ship in flame/assets (the SFT and DPO examples of the
README and the tests): arithmetic questions, answered correctly (chat), and a correct against a wrong answer
(preference). Seeded, so running it again writes the same files.

    python scripts/build_post_training_samples.py
"""

import json
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "flame" / "assets"
ROWS = 512


def question(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randrange(100), rng.randrange(100)
    if rng.random() < 0.5:
        return f"{a} + {b}", a + b
    return f"{a} - {b}", a - b


def main() -> None:
    rng = random.Random(0)
    chat, preference = [], []
    for _ in range(ROWS):
        expression, value = question(rng)
        prompt = f"What is {expression}?"
        chat.append({"messages": [{"role": "user", "content": prompt},
                                  {"role": "assistant", "content": f"{expression} = {value}."}]})  # fmt: skip
        wrong = value + rng.choice([-1, 1]) * rng.randrange(1, 10)
        preference.append(
            {"prompt": prompt, "chosen": f"{expression} = {value}.", "rejected": f"{expression} = {wrong}."}
        )
    for folder, rows in (("chat", chat), ("preference", preference)):
        path = ASSETS / folder / "train.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
