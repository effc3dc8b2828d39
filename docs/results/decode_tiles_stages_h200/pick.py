"""Prints the winning tiles of decode_tiles JSON files as w1_tiles.py's argument ('HD,store=B,W,S,P;...')."""

import json
import sys

items = []
for path in sys.argv[1:]:
    try:
        with open(path) as f:
            d = json.load(f)
    except Exception:
        continue
    for name, b in d["best"].items():
        hd = 128 if "x128" in name else 64
        store = name.split()[-1]
        w = b["best"]
        if b["gain"] > 1.02 or b["gain"] != b["gain"]:
            items.append(f"{hd},{store}={w['block_n']},{w['num_warps']},{w['num_stages']},{w['fp8_products']}")
        print(
            name,
            "best",
            tuple(w.values()),
            b["best_us"],
            "current",
            b["current_us"],
            f"gain {b['gain']:.3f}",
            file=sys.stderr,
        )
print(";".join(items) or "default")
