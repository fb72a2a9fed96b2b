"""Random caption-like lines for comparing the Python PTB tokenizer with the jar (used by
tests/test_ptb.py and benchmarks/ptb_parity.py): words with the punctuation, clitics,
abbreviations, entities, numbers, URLs, quotes and non-ASCII characters captions hold, glued
together in unlikely ways, and lines of random characters."""

from __future__ import annotations

import random

WORDS = ("a the dog dogs man woman girl boy runs jumps on in grass red blue ball two people water snow "
         "bike cat sits table pizza sauce mushrooms cheese hat shirt street sign kite beach plate").split()
CAPITALISED = ("A The He She It In At As An But If One Our So Some That They This We When What You Many More "
               "Now Once Other Since Such Then There These Their Yet Here Her However Last Zebra Dog New York I "
               "\u00c9lan \u00dcber").split()
ABBREVIATIONS = ("Mr Mrs Ms Dr St Ave Jr Sr Inc Co Corp Ltd etc vs No no Mt Ft ft Jan Feb Dec Mon Fri Calif Mass "
                 "Ill Pa Wash Tex Rd Blvd Dept Gov Gen Prof e.g i.e a.m p.m U.S U.S.A U.K D.C a b x I U A Wii "
                 "Ph.D Esq al Bldg sq tel est ca fig pp op art prop nos cf Jos Wm").split()
SPECIAL = ["don't", "can't", "it's", "dog's", "dogs'", "y'all", "o'clock", "'em", "rock'n'roll", "'n'", "'til",
           "'cause", "'90s", "90's", "d'Avignon", "O'Neil", "cannot", "gonna", "gotta", "wanna", "'tis", "'twas",
           "ma'am", "C'mon", "cont'd", "I'm", "they're", "shouldn't've", "n't", "'s", "don\u2019t", "\u2018tis",
           "t-shirt", "5-year-old", "x-ray", "non-stop", "pro-", "anti-", "a--b", "beach--kite", "M&Ms", "AT&T",
           "at&t", "S&P-500", "q&a", "&amp;", "&quot;", "&lt;", "&gt;", "&apos;", "&#39;", "&nbsp;", "&copy;",
           "&mdash;", "&eacute;", "caf&eacute;", "&AMP;", "&QUOT;", "<|endoftext|>", "<b>", "</b>", "<br/>",
           "<unk>", "5", "1,000", "3.5", "10:30", "1/2", "5 1/2", "1990s", "2nd", "100%", "$5.99", "#1", "@home",
           "#hashtag", "4x4", "-5", ".5", "(555) 555-1234", "11/22/2013", "2013-10-15", "a/b", "www.google.com",
           "http://x.com/a?b=c", "foo@bar.com", "google.com", ":)", ":-)", ":D", "^_^", "(^_^)", "<3", "c++",
           "...", "..", "....", ". . .", "\u2026", "\u2014", "\u2013", "-", "--", "---", "\u201c", "\u201d",
           "\u2018", "\u2019", "\"", "'", "`", "``", "''", "\u00ab", "\u00bb", "(", ")", "[", "]", "{", "}", "<",
           ">", "&", "*", "\\*", "_", "@", "#", "+", "=", "~", "^", "|", "\\", "/", "%", "$", "\u00a2", "\u00a3",
           "\u20ac", "\u00bd", "\u00b2", "\u00a9", "\U0001F600", "\u200b", "\u00ad", "\ufeff", "\u00a0",
           "\u00e9", "\u00df", "\u03a9", "\u044f", "\u4e2d\u6587", "x\u0301", "-LRB-", "C.D.s", "Cap'n", "'10",
           "th'", "b'gosh", "nor'easter", "Yahoo!", "hi!hello", "dog.The", "a.b.c", "Mr.Smith", "1st.", "3.14.",
           "sauce,mushrooms", "toilet,bathtub.In", "Wii U.", "photo.jpg", "23.h", "x_y", "a1b", "\u00e9-\u00f1",
           "a-U.S.", "U.S.-U.K.", "a\u058ab", "\u2010", "\t", "  ", "\u2003"]
PREFIXES = ["", "", "", "", "\"", "'", "(", "[", "{", "\u201c", "\u2018", "`", "``", "$", "#", "@", "-", "--", "<",
            "*", "...", "\u00ab"]
SUFFIXES = ["", "", "", "", "", ".", ",", ";", ":", "!", "?", "...", "!?", "\"", "'", ")", "]", "}", "\u201d",
            "\u2019", "'s", "s'", "n't", "%", "-", "--", ".)", ".\"", ",\"", "'.", "..", "....", ">", "*", "\u00bb"]
SEPARATORS = [" "] * 12 + ["", "  ", "\u00a0", "\t", " . ", " , ", "-", "/", "&", ".", ","]
CHARS = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") * 3 + [" "] * 40
         + list(".,;:!?'\"`-_/\\()[]{}<>@#$%^&*+=|~") * 2
         + list("\u00e9\u00f1\u00fc\u2019\u2018\u201c\u201d\u2014\u2013\u2026\u00ab\u00bb\u00bd\u00a3\u20ac\u00a2"
                "\u00a0\u00ad\u200b\U0001F600")
         + ["&amp;", "&quot;", "&apos;", "&lt;", "&gt;", "&nbsp;", "n't", "'s", "'ll", "...", "--", "www.", ".com",
            "http://", "Mr.", "U.S.", "etc.", " The ", " A ", "St."])


def _word(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.45:
        w = rng.choice(WORDS)
        w = w.upper() if rng.random() < 0.1 else w.capitalize() if rng.random() < 0.15 else w
    elif r < 0.6:
        w = rng.choice(CAPITALISED)
    elif r < 0.72:
        w = rng.choice(ABBREVIATIONS) + rng.choice([".", ".", "", ". "])
    else:
        w = rng.choice(SPECIAL)
    if rng.random() < 0.3:
        w = rng.choice(PREFIXES) + w
    if rng.random() < 0.35:
        w += rng.choice(SUFFIXES)
    return w


def caption_like(rng: random.Random) -> str:
    words = [_word(rng) for _ in range(rng.randint(1, 14))]
    return "".join(w + (rng.choice(SEPARATORS) if i < len(words) - 1 else "") for i, w in enumerate(words))


def character_soup(rng: random.Random) -> str:
    return "".join(rng.choice(CHARS) for _ in range(rng.randint(1, 40)))


def random_lines(n: int, seed: int) -> list[str]:
    """``n`` lines, half caption-like, half random characters, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [caption_like(rng) if i % 2 == 0 else character_soup(rng) for i in range(n)]
