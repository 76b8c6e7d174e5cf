"""Text-rendering prompts for the OCR reward: scene templates with a quoted text slot, filled from a word list.

``python -m unirl_pl.rewards.ocr_prompts --split train --count 1024 > recipes/prompts/ocr_train.txt``
writes the training prompts of ``recipes/sd35_ocr.yaml`` (``--split val`` the held-out ones). The texts
of the two splits are disjoint (every eighth entry of :data:`TEXTS` is held out), so validation measures
rendering words the generator was never rewarded for. Each prompt quotes exactly one text, which
:func:`unirl_pl.rewards.ocr.quoted_text` extracts as the OCR target.
"""

from __future__ import annotations

import argparse
import random
from typing import Literal

# Short texts of one to three words, upper and mixed case, with a few digits: what signage, labels and
# covers in generated images usually say. Written for this project.
# fmt: off
TEXTS: tuple[str, ...] = (
    "OPEN", "Fresh Bread", "EXIT", "No Parking", "Welcome Home", "SALE", "Coffee", "Hotel", "Books", "Stop",
    "Good Morning", "Bakery", "Gym", "Library", "Cinema", "Pizza", "Taxi", "Flowers", "Garden", "Museum", "Tea Time",
    "Keep Calm", "Dream Big", "Hello", "Thank You", "Happy Birthday", "Bus Stop", "Pharmacy", "Ice Cream",
    "Fish Market", "Jazz Night", "Live Music", "Bike Shop", "Bar", "Surf Club", "Lemonade", "Post Office",
    "Fire Station", "School", "Hospital", "Bank", "Station", "Platform 9", "Route 66", "Room 404", "Gate 12",
    "Exit 3", "Level 2", "Sunset Diner", "Moon Cafe", "Star Wash", "Blue Lagoon", "Red Fox", "Green Leaf",
    "Golden Gate", "Silver Lake", "Rainy Days", "Winter Sale", "Summer Camp", "Spring Fair", "Autumn Market",
    "Night Owl", "Early Bird", "Big Ideas", "Think", "Create", "Explore", "Believe", "Relax", "Smile", "Adventure",
    "Harmony", "Wild", "Freedom", "Focus", "Code", "Data", "Robot", "Rocket", "Galaxy", "Planet X", "Ocean", "River",
    "Mountain", "Forest", "Desert", "Island", "Volcano", "Bridge", "Tower", "Castle", "Lighthouse", "Harbor",
    "Farm Stand", "Eggs", "Honey", "Apples", "Cheese", "Soup", "Noodles", "Tacos", "Sushi", "Burgers", "Donuts",
    "Pancakes", "Waffles", "Juice Bar", "Vintage", "Antiques", "Records", "Comics", "Toys", "Games", "Arcade",
    "Bowling", "Skate Park", "Pool", "Spa", "Salon", "Barber", "Tattoo", "Repair", "Laundry", "Tickets", "Gallery",
    "Studio 5", "Theater", "Opera", "Circus", "Zoo", "Aquarium", "Park", "Trail", "Camping", "Beach", "Marina",
    "Airport", "Hangar 7", "Garage", "Workshop", "Lab", "Quiet Please", "Danger", "Caution", "Wet Paint", "Closed",
    "Sold Out", "Free Wifi", "Push", "Pull", "Entrance",
)
# fmt: on

# Scenes with a place where text naturally appears; {text} is quoted with straight double quotes.
TEMPLATES: tuple[str, ...] = (
    'A wooden sign that says "{text}" hanging outside a shop',
    'A neon sign reading "{text}" glowing on a brick wall at night',
    'A chalkboard menu with "{text}" written in white chalk',
    'A storefront window painted with the words "{text}"',
    'A coffee mug printed with "{text}" on a kitchen table',
    'A T-shirt with "{text}" in bold letters, flat lay photo',
    'A book cover titled "{text}" on a library shelf',
    'A street sign that says "{text}" on a sunny day',
    'A birthday cake with "{text}" written in icing',
    'A poster with the headline "{text}" on a city wall',
    'A road billboard displaying "{text}" above a highway',
    'A hand-written note that says "{text}" pinned to a corkboard',
    'A vintage tin sign reading "{text}" in a garage',
    'A banner with "{text}" stretched across a festival street',
    'A license plate that reads "{text}" on an old car',
    'A cardboard box labeled "{text}" in a warehouse',
    'A glass door with "{text}" in gold lettering',
    'A sand drawing of the word "{text}" on a beach',
    'A cloud of smoke forming the letters "{text}" in the sky',
    'A tote bag with "{text}" embroidered on it',
    'A museum plaque engraved with "{text}"',
    'A laptop screen showing "{text}" in large type',
    'A flag waving with "{text}" printed on it',
    'A bakery box stamped with "{text}"',
)


def split_texts(split: Literal["train", "val"]) -> list[str]:
    """The texts of a split: every eighth entry of :data:`TEXTS` is held out for ``val``."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    held_out = split == "val"
    return [t for i, t in enumerate(TEXTS) if (i % 8 == 7) == held_out]


def make_prompts(split: Literal["train", "val"], count: int, seed: int = 0) -> list[str]:
    """``count`` prompts of ``split``: every (template, text) pair once in a seeded order, cycling if
    ``count`` exceeds their number; deterministic for a seed."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    pairs = [(template, text) for template in TEMPLATES for text in split_texts(split)]
    random.Random(seed).shuffle(pairs)
    return [pairs[i % len(pairs)][0].format(text=pairs[i % len(pairs)][1]) for i in range(count)]


def main(argv: list[str] | None = None) -> None:
    """Print the prompts of a split, one per line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=["train", "val"], default="train")
    parser.add_argument("--count", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print("\n".join(make_prompts(args.split, args.count, args.seed)))


if __name__ == "__main__":
    main()
