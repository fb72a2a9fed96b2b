"""The Stanford PTBTokenizer of CoreNLP 3.4.1 (the jar pycocoevalcap ships), re-implemented in
Python for what coco-caption runs it on: ``-preserveLines -lowerCase`` over one text holding one
caption per line.

Written from the jar's observed behaviour (``benchmarks/ptb_parity.py`` probes it and compares
this module with it character by character and caption by caption), following the rule names of
the PTBLexer grammar. Like the jar it is a longest-match lexer: at each position every rule is
tried, the longest match wins (a rule's trailing context counts towards its length, as in JFlex)
and ties go to the rule listed first. Its notable behaviours:

- A caption's tokens can depend on the next line: an abbreviation at the end of a line is split
  from its period when the next line starts with a capital letter ("etc." then "The ...") or,
  for initials and acronyms ("U.", "p.m."), with one of a few sentence-opening words ("A",
  "The", "He", ...). So captions are tokenised as one text, in order, as the jar does.
- HTML entities: &amp; is "&", &quot; a double quote, &apos; a single one, &mdash; / &ndash; /
  &MD; a dash "--", &nbsp; a space; &lt; and &gt; are "<" and ">"; other entities split at "&"
  and ";".
- Quotes become `` '' ` ' (LaTeX style), dashes "--", "..." and U+2026 "...", brackets -LRB-
  -RRB- -LSB- -RSB- -LCB- -RCB-, currency signs $ (euro), # (pound), "cents".
- Characters the jar does not know (emoji, zero-width spaces, most control and unassigned code
  points, anything beyond U+FFFF) are dropped; SGML tags, fractions and phone numbers keep their
  inner spaces as U+00A0.

The character classes below were read off the jar (every code point up to U+FFFF, probed in
context; see ``benchmarks/ptb_parity.py --chars``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

from ._ptb_chars import ALNUM, DELETED, DIGIT, LETTER, UPPER

# ---- character classes and macros (regular-expression source) ------------------------------
SPACE_CHARS = " \t\u00a0\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u3000"
SPACE = "[ \\t\\u00a0\\u2000-\\u200a\\u3000]"
SPACENL = "[ \\t\\u00a0\\u2000-\\u200a\\u3000\\n]"
SPLET = "&[aeiouAEIOU](?i:acute|grave|uml);"  # an accented letter as an entity, kept as it is
L = f"(?:[{LETTER}\\u00ad]|{SPLET})"  # a letter of a word (soft hyphens are removed from words)
AN = f"[{ALNUM}]"  # a letter or digit of a hyphenated thing (no combining marks)
AN_SHY = f"[{ALNUM}\\u00ad]"  # the same or a soft hyphen (which file names keep)
HYPHEN = "[_\\-\\u058a\\u2010\\u2011]"
D = f"[{DIGIT}]"
UP = f"[{UPPER}]"
AZ09 = "[A-Za-z0-9]"
_NAME = "[A-Za-z][A-Za-z0-9:._\\-]*"
SGML = (f"<(?:[!?][A-Za-z\\-][^>\\n]*|\\/{_NAME} *|{_NAME}(?: +{_NAME}(?: *= *(?:'[^'\\n]*'|\"[^\"\\n]*\"))?)*"
        " *\\/? *)>")  # a comment, a closing tag, or an opening one whose attribute values are quoted
APOS = "(?:['\\u0092\\u2019]|&(?i:apos);)"
APOSETC = f"(?:{APOS}|[`\\u0091\\u2018\\u201b])"
REDAUX = f"(?:{APOS}(?:[msdMSD]|(?i:re|ve|ll)))"
SREDAUX = f"(?:[nN]{APOSETC}[tT])"
WORD = f"(?:{L}(?:{L}|{D})*(?:[.!?]{L}(?:{L}|{D})*)*)"
SWORD = "(?:[A-Za-z\\u00ad]*[A-MO-Za-mo-z]\\u00ad*)"
NUM = f"(?:{D}*(?:[.:,\\u00ad\\u066b\\u066c]{D}+)+|{D}+)"
ACRO = "(?:U\\.S\\.-(?:U\\.S\\.S\\.R|U\\.K)|(?i:Canada|Sino|Korean|EU|Japan|non)-U\\.S|[A-Za-z](?:\\.[A-Za-z])+)"
ABBREV1 = ("(?:(?i:Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sept|Sep|Oct|Nov|Dec|Mon|Tues|Tue|Wed|Thurs|Thu|Fri"
           "|Ala|Ariz|Calif|Colo|Conn|Ct|Dak|Fla|Ga|Ind|Kans|Kan|Ky|Md|Mich|Minn|Mont|Mo|Neb|Nev|Okla"
           "|Penn|Tenn|Va|Vt|Wisc|Wis|Wyo|Inc|Cos|Co|Corp|Pp?t[ye]s?|Ltd|Plc|Rt|Bancorp|Bhd|Assn|Univ"
           "|Intl|Sys|tel|est|ext|sq|Jr|Sr|Bros|Ed\\.D|Ph\\.D|Esq|etc|al|seq|Bldg|Rd|Blvd)"
           "|A(?i:z|rk)|D(?i:el)|I(?i:ll)|L(?i:a)|M(?i:ass|iss)|O(?i:re)|P(?i:a)|T(?i:ex)|W(?i:ash))\\.")
ABBREV2 = ("(?:(?i:Mrs|Mr|Ms|Drs|Dr|Profs|Prof|Sens|Sen|Reps|Rep|Attys|Atty|Lt|Col|Gen|Messrs|Govs"
           "|Gov|Adm|Rev|Maj|Sgt|Cpl|Pvt|Capt|Ste|St|Ave|Pres|Lieut|Hon|Brig|Comdr|Cmdr|Pfc|Spc|Supts"
           "|Supt|Det|Mt|Ft|Adj|Adv|Asst|Assoc|Ens|Insp|Mlle|Mme|Msgr|Sfc|Invt|Elec|Natl|Mfg|Mtg|Dept"
           f"|vs|Alex|Cie|TREAS|Wm|Jos|cf|Ph)|{ACRO}|[A-Za-z])\\.")
ACRONYM = f"(?:{ACRO}|[A-Za-z])\\."  # initials and acronyms: split before a sentence opener
OPENERS = ("(?:A(?i:bout|ccording|dditionally|fter|n|s|t)?|B(?i:ut)|E(?i:arlier)"
           "|H(?i:e|er|ere|owever)|I(?i:f|n|t)|L(?i:ast)|M(?i:any|ore|r\\.|s\\.)|N(?i:ow)"
           "|O(?i:nce|ne|ther|ur)|S(?i:he|ince|o|ome|uch)|T(?i:hat|he|heir|hen|here|hese|hey|his)"
           f"|W(?i:e|hen|hile|hat)|Y(?i:et|ou)|{SGML})")
ABBREV3 = "(?i:ca|figs?|prop|nos?|art|pp|op)\\."  # abbreviations kept only before a number
DBLQUOT = "(?:\"|&(?i:quot);)"
QUOTES = [APOS, "''", ("[`\\u0091-\\u0094\\u2018\\u2019\\u201a-\\u201e\\u2039\\u203a"
                      "\\u00ab\\u00bb]{1,2}")]
THING = f"(?:(?:[dDoOlL]{APOSETC}{AN})?{AN}+(?:{HYPHEN}(?:[dDoOlL]{APOSETC}{AN})?{AN}+)*)"  # d'/o'/l' may open a part
HTHING = f"(?:{AZ09}[A-Za-z0-9.,\\u00ad]*(?:-(?:{ACRO}\\.|[A-Za-z0-9\\u00ad]+))+)"
THING3 = "(?:[A-Za-z0-9]+(?:-[A-Za-z]+){0,2}(?:\\\\?\\/[A-Za-z0-9]+(?:-[A-Za-z]+){0,2}){1,2})"
LP = f"(?:(?![{DIGIT}])[{ALNUM}])"  # a letter proper: no digit, combining mark, soft hyphen or entity
APOWORD = [f"{APOS}(?i:n){APOS}?", f"[lLdDjJ]{APOS}", f"(?i:Dunkin|somethin|ol){APOS}", f"{APOS}(?i:em)",
           f"[A-HJ-XZn]{APOSETC}{LP}{{2}}{LP}*", f"{APOS}[2-9]0(?i:s)", f"{APOS}(?i:till?)",
           f"{LP}+[aeiouyAEIOUY]{APOSETC}[aeiouA-Z]{LP}*", f"{APOS}(?i:cause)",
           "(?i:nor'easter|c'mon|e'er|s'mores|ev'ry|li'l|nat'l)", f"(?i:O{APOSETC}o)"]
FULLURL = "(?i:https?|ftp):\\/\\/[^ \\t\\n\\f\\r\"<>|(){}]+[^ \\t\\n\\f\\r\"<>|.!?(){},-]"
FILENAME = (f"{AN_SHY}+(?:\\.{AN_SHY}+)*\\.(?i:bat|bmp|class|cpp|c|docx|doc|exe|gif|gz|html|htm|h|jar|java|jpeg|jpg|mov"
            "|mp3|pdf|php|pl|png|ppt|ps|py|sql|tar|txt|wav|xml|zip|dll|x)")
# (",-_" in the domain class is a range, from "," to "_", as in the jar's grammar: no capitals,
# digits, ":", "/" or "@" there)
_URLPATH = "(?:\\/[^ \\t\\n\\f\\r\"<>|()]+[^ \\t\\n\\f\\r\"<>|.!?(){},-])?"
_WWW = "www\\.(?:[^ \\t\\n\\f\\r\"<>|.!?(){},SLASH]+\\.)+[a-zA-Z]{2,4}"
# (the second form is the first with no "/" in the host, for the longest match that the jar
# finds where Python's regular expressions stop at the first)
LIKELYURL = [_WWW.replace("SLASH", "") + _URLPATH, _WWW.replace("SLASH", "/") + _URLPATH,
             "(?:[^ \\t\\n\\f\\r\"`'<>|.!?(){},-_$]+\\.)+(?i:com|net|org|edu)" + _URLPATH]
EMAIL = ("(?:&(?i:lt);|<)?[a-zA-Z0-9][^ \\t\\n\\f\\r\"<>|()\\u00a0{}]*@(?:[^ \\t\\n\\f\\r\"<>|(){}.\\u00a0]+\\.)*"
         "[^ \\t\\n\\f\\r\"<>|(){}.\\u00a0]+(?:&(?i:gt);|>)?")
PHONE = ("(?:\\([0-9]{2,3}\\)[ \\u00a0]?|(?:\\+\\+?)?(?:[0-9]{2,4}[\\- \\u00a0])?[0-9]{2,4}[\\- \\u00a0])"
         "[0-9]{3,4}[\\- \\u00a0]?[0-9]{3,5}")
SMILEY = "[<>]?[:;=][\\-o\\*']?[\\(\\)DPdpO\\\\{@\\|\\[\\]]"
ASIANSMILEY = ("(?:[\\-\\^x=~<>']_[\\-\\^x=~<>']|\\([\\-\\^x=~<>'][_.]?[\\-\\^x=~<>']\\)"
               "|\\([\\^x=~<>']-[\\^x=~<>'`]\\))")

# ---- token transformations -----------------------------------------------------------------
_BRACKETS = {"(": "-LRB-", ")": "-RRB-", "[": "-LSB-", "]": "-RSB-", "{": "-LCB-", "}": "-RCB-"}
_QUOTE_CHARS = {"\u0091": "`", "\u2018": "`", "\u201b": "`", "\u2039": "`", "\u0092": "'",
                "\u2019": "'", "\u203a": "'", "\u0093": "``", "\u201c": "``", "\u00ab": "``",
                "\u0094": "''", "\u201d": "''", "\u00bb": "''"}
_CURRENCY = {"\u00a2": "cents", "\u00a3": "#", "\u00a4": "$", "\u0080": "$", "\u20a0": "$", "\u20ac": "$"}
_FRACTIONS = {"\u00bc": "1/4", "\u00bd": "1/2", "\u00be": "3/4", "\u2153": "1/3", "\u2154": "2/3"}


def _quotes(tok: str, left: bool = False) -> str:
    """LaTeX-style quotes; the entities only in lower case (the jar's replacement is
    case-sensitive, though its lexer is not)."""
    tok = tok.replace("&apos;", "`" if left else "'").replace("&quot;", "``" if left else "''")
    if left:
        tok = tok.replace("'", "`").replace('"', "``")
    else:
        tok = tok.replace('"', "''")
    return "".join(_QUOTE_CHARS.get(c, c) for c in tok)


def _parens(tok: str) -> str:
    return tok.replace("(", "-LRB-").replace(")", "-RRB-")


def _spaces(tok: str) -> str:
    return re.sub(SPACE, "\u00a0", tok)


def _hyphens(tok: str) -> str:
    return "--" if 2 <= len(tok) <= 4 else tok


# ---- rules ---------------------------------------------------------------------------------
Action = Callable[[str], "str | tuple[str | None, int] | None"]


@dataclass
class Rule:
    """``pattern`` followed by ``trail`` (trailing context: it must follow and counts towards
    the match length, but is not consumed). ``action`` turns the matched text into a token (or
    None for no token), or into (token, consumed length) where it gives text back."""

    name: str
    pattern: str | list[str]  # a list: alternatives, of which the longest match counts
    action: Action
    trail: str | None = None
    first: str = "[\\s\\S]"  # the characters a match can start with (a regular-expression class)

    # compiled on first use: a set of plain captions never needs most rules, and compiling them
    # all (large Unicode classes) would cost a fifth of a second at every start
    @functools.cached_property
    def mains(self) -> list[re.Pattern]:
        alternatives = self.pattern if isinstance(self.pattern, list) else [self.pattern]
        # the trailing context as a look-ahead too, so that the pattern backtracks to a match it allows
        ahead = f"(?={self.trail})" if self.trail is not None else ""
        return [re.compile(f"(?:{p}){ahead}") for p in alternatives]

    @functools.cached_property
    def starts(self) -> re.Pattern:
        return re.compile(self.first)

    @functools.cached_property
    def after(self) -> re.Pattern | None:
        return re.compile(f"(?:{self.trail})") if self.trail is not None else None

    def match(self, text: str, pos: int) -> tuple[int, int]:
        """(length with trailing context, length without) of the longest match at ``pos``,
        (0, 0) if none."""
        best = (0, 0)
        for main in self.mains:
            m = main.match(text, pos)
            if m is None:
                continue
            end = m.end()
            total = end
            if self.after is not None:
                t = self.after.match(text, end)
                if t is None:
                    continue
                total = t.end()
            if total - pos > best[0]:
                best = (total - pos, end - pos)
        return best


def keep(tok: str) -> str:
    return tok


def word(tok: str) -> str:
    """A word without its soft hyphens (one alone is a hyphen)."""
    return tok.replace("\u00ad", "") or "-"


def skip(tok: str) -> None:
    return None


def const(value: str) -> Action:
    return lambda tok: value


def pushback(n: int) -> Action:
    return lambda tok: (tok[:-n], len(tok) - n)


def repeat_period(tok: str) -> tuple[str, int]:
    """An abbreviation ending a sentence: kept with its period, and a period token follows."""
    return tok, len(tok) - 1


def acronym(tok: str) -> tuple[str, int]:
    """An initial ("U.") before a sentence opener loses its period, which becomes a token; a
    longer acronym ("p.m.") keeps it and a period token follows too."""
    if len(tok) == 2:
        return tok[0], 1
    return tok, len(tok) - 1


# First characters, to try only the rules that can match at a position.
_LETTER1 = f"[{LETTER}\\u00ad&]"  # a word's first character (& for an entity like &eacute;)
_APOS1 = "['`\\u0091-\\u0094\\u2018\\u2019\\u201a-\\u201e\\u2039\\u203a\\u00ab\\u00bb&]"
_NUM1 = f"[{DIGIT}\\-+.:,\\u00ad\\u066b\\u066c]"

RULES: list[Rule] = [
    Rule("space", f"(?:{SPACE}|&(?i:nbsp);)+", skip, first=f"[{SPACE_CHARS}&]"),
    Rule("sgml", SGML, _spaces, first="<"),
    Rule("spmdash", "&(?i:MD|mdash|ndash);|[\\u0096\\u0097\\u2013\\u2014\\u2015]", const("--"),
         first="[&\\u0096\\u0097\\u2013\\u2014\\u2015]"),
    Rule("spamp", "&(?i:amp);", const("&"), first="&"),
    Rule("sppunc", "&(?i:HT|TL|UR|LR|QC|QL|QR|odq|cdq|#[0-9]+);", keep, first="&"),
    Rule("lt", "&(?i:lt);", const("<"), first="&"),
    Rule("gt", "&(?i:gt);", const(">"), first="&"),
    Rule("word-redaux", WORD, word, trail=REDAUX, first=_LETTER1),
    Rule("sword-sredaux", SWORD, word, trail=SREDAUX, first="[A-Za-z\\u00ad]"),
    Rule("assimilation3", "(?i:cannot|'twas)", pushback(3), first="[cC']"),
    Rule("assimilation2", "(?i:'tis|gonna|gotta|lemme|gimme|wanna)", pushback(2), first="['gGlLwW]"),
    Rule("word", WORD, word, first=_LETTER1),
    Rule("proglang", "(?i:c\\+\\+|[cf]#)", keep, first="[cCfF]"),
    Rule("apoword", APOWORD, keep, first=f"(?:{_LETTER1}|{_APOS1})"),
    Rule("yapos", f"[yY]{APOS}", keep, trail=LP, first="[yY]"),
    Rule("fullurl", FULLURL, keep, first="[hHfF]"),
    Rule("likelyurl", LIKELYURL, keep, first="[^ \\t\\n\\f\\r\"<>|.!?(){},]"),
    Rule("email", EMAIL, keep, first="[a-zA-Z0-9<&]"),
    Rule("twitter", f"@[A-Za-z_][A-Za-z_0-9]*|#{L}+", keep, first="[@#]"),
    Rule("redaux", REDAUX, _quotes, trail="[^A-Za-z]", first=_APOS1),
    Rule("sredaux", SREDAUX, _quotes, first="[nN]"),
    Rule("date", f"{D}{{1,2}}[\\-\\/]{D}{{1,2}}[\\-\\/]{D}{{2,4}}", keep, first=D),
    Rule("number", f"[\\-+]?{NUM}", word, first=_NUM1),
    Rule("subsupnum", "[\\u207a\\u207b\\u208a\\u208b]?(?:[\\u2070\\u00b9\\u00b2\\u00b3\\u2074-\\u2079]+|[\\u2080-\\u2089]+)",
         keep, first="[\\u207a\\u207b\\u208a\\u208b\\u2070\\u00b9\\u00b2\\u00b3\\u2074-\\u2079\\u2080-\\u2089]"),
    Rule("frac", f"(?:{D}{{1,4}}[- \\u00a0])?{D}{{1,4}}(?:\\\\?\\/|\\u2044){D}{{1,4}}", _spaces, first=D),
    Rule("frac2", "[\\u00bc\\u00bd\\u00be\\u2153-\\u215e]", lambda t: _FRACTIONS.get(t, t),
         first="[\\u00bc\\u00bd\\u00be\\u2153-\\u215e]"),
    Rule("tbspec", "-(?i:RRB|LRB|RCB|LCB|RSB|LSB)-|(?i:C\\.D\\.s|pro-|anti-|S(?:&|&amp;)P-500|S(?:&|&amp;)Ls"
         f"|Cap{APOS}n|c{APOS}est|cont'd\\.)", lambda t: re.sub("(?i)&amp;", "&", t), first="[-cCpPaAsS]"),
    Rule("thing3", THING3, keep, first="[A-Za-z0-9]"),
    Rule("dolsign", "[A-Z]*\\$|#", keep, first="[A-Z$#]"),
    Rule("dolsign2", f"[{''.join(_CURRENCY)}\\u00a5\\u060b\\u0e3f\\u20a4\\uffe0\\uffe1\\uffe5\\uffe6]",
         lambda t: _CURRENCY.get(t, t), first=f"[{''.join(_CURRENCY)}\\u00a5\\u060b\\u0e3f\\u20a4\\uffe0\\uffe1\\uffe5\\uffe6]"),
    Rule("abbrev1-sentend", ABBREV1, repeat_period, trail=f"{SPACENL}(?:{SPACENL}|{UP}|{SGML})", first="[A-Za-z]"),
    Rule("abbrev1", ABBREV1, keep, trail="[\\s\\S]{2}", first="[A-Za-z]"),
    Rule("abbrev1-end", ABBREV1, repeat_period, first="[A-Za-z]"),  # less than 2 characters left
    Rule("acronym-opener", ACRONYM, acronym, trail=f"{SPACENL}+{OPENERS}{SPACENL}", first="[A-Za-z]"),
    Rule("abbrev3", ABBREV3, keep, trail=f"{SPACENL}?{D}", first="[A-Za-z]"),
    Rule("abbrev2", ABBREV2, keep, first="[A-Za-z]"),
    Rule("acro-space", ACRO, keep, trail=SPACENL, first="[A-Za-z]"),
    Rule("tbspec2", f"{APOS}[0-9][0-9]", keep, trail=SPACENL, first=_APOS1),
    Rule("filename", FILENAME, keep, trail=f"{SPACENL}|[.?!,]", first=AN_SHY),
    Rule("word-period", [WORD + "\\.", THING + "\\.", HTHING + "\\."], word, trail="[,;:]",
         first=f"(?:{_LETTER1}|{D})"),
    Rule("phone", PHONE, lambda t: _spaces(_parens(t)), first="[(+0-9]"),
    Rule("dblquot-left", DBLQUOT, lambda t: _quotes(t, left=True), trail="[A-Za-z0-9$]", first="[\"&]"),
    Rule("dblquot", DBLQUOT, _quotes, first="[\"&]"),
    Rule("smiley", SMILEY, _parens, trail="[^A-Za-z0-9]", first="[<>:;=]"),
    Rule("asiansmiley", ASIANSMILEY, _parens, first="[-^x=~<>'(]"),
    Rule("symbol", "[+%&~^|\\\\]", keep, first="[+%&~^|\\\\]"),
    Rule("bracket", "[()\\[\\]{}]", lambda t: _BRACKETS[t], first="[()\\[\\]{}]"),
    Rule("fakeduckfeet", "<<|>>", keep, first="[<>]"),
    Rule("lessgreater", "[<>]", keep, first="[<>]"),
    Rule("hyphens", "-+", _hyphens, first="-"),
    Rule("ldots", "\\.{3,5}|(?:\\.[ \\u00a0]){2,4}\\.|[\\u0085\\u2026]", const("..."), first="[.\\u0085\\u2026]"),
    Rule("fnmarks", "@+|#+|_+", keep, first="[@#_]"),
    Rule("asts", "\\*+|(?:\\\\\\*){1,3}", keep, first="[*\\\\]"),
    Rule("insentp", "[,;:]", keep, first="[,;:]"),
    Rule("period", "\\.", keep, first="\\."),
    Rule("bangs", "[?!]+", keep, first="[?!]"),
    Rule("equals", "=", keep, first="="),
    Rule("slash", "\\/", keep, first="/"),
    Rule("hthing", HTHING, word, first="[A-Za-z0-9]"),
    Rule("thing", THING, word, first=f"(?:{AN}|[dDoOlL])"),
    Rule("thinga", "[A-Z]+(?:(?:[+&]|&(?i:amp);)[A-Z]+)+", lambda t: re.sub("(?i)&amp;", "&", t), first="[A-Z]"),
    Rule("quote-letter", "'", const("`"), trail=f"[A-Za-z][^\\n{SPACE_CHARS}]", first="'"),
    Rule("redaux-any", REDAUX, _quotes, first=_APOS1),  # (apostrophes only: a left quote and "s" stay apart)
    Rule("quotes", QUOTES, _quotes, first=_APOS1),
]

_DELETED = re.compile(f"[{DELETED}\\ud800-\\udfff]")
_ASTRAL = re.compile("[^\\u0000-\\uffff]")


def _surrogates(c: str) -> str:
    """A character beyond U+FFFF as the two surrogates Java sees: it drops them, but inside a URL
    or an e-mail address they count as two characters and stay."""
    o = ord(c)
    if o <= 0xFFFF:
        return c
    o -= 0x10000
    return chr(0xD800 + (o >> 10)) + chr(0xDC00 + (o & 0x3FF))


def _from_utf16_units(tok: str) -> str:
    return tok.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


_CANDIDATES: dict[str, tuple[Rule, ...]] = {}


def _candidates(c: str) -> tuple[Rule, ...]:
    """The rules that can match at a character ``c`` (in priority order), cached per character."""
    got = _CANDIDATES.get(c)
    if got is None:
        got = _CANDIDATES[c] = tuple(r for r in RULES if r.starts.match(c))
    return got


def _longest(text: str, pos: int, rules: tuple[Rule, ...] | list[Rule]) -> tuple[Rule, str] | None:
    """The rule that wins at ``pos`` and its matched text (trailing context excluded)."""
    best, best_len, best_text = None, 0, ""
    for rule in rules:
        total, length = rule.match(text, pos)
        if total > best_len:
            best, best_len, best_text = rule, total, text[pos:pos + length]
    return (best, best_text) if best is not None else None


# Shortcuts for the common case, which give what the rules give: a plain word followed by a space,
# a line end or a sentence-final period (unless the tokenizer splits it, or it could be an
# abbreviation), and a period or comma followed by a space that does not start ". . .".
_PLAIN = re.compile("([A-Za-z]+)(?:(?=[ \\n]|$)|(?=\\.(?:[ \\n]|$)))|([.,])(?= [^.]|\\n|$)")
_SPACES = re.compile(f"{SPACE}+")
_SPLIT_WORDS = {"cannot", "gonna", "gotta", "lemme", "gimme", "wanna"}
_HAS_SPLIT_WORD = re.compile("(?i)" + "|".join(_SPLIT_WORDS))
_RUN = re.compile(f"(?:[A-Za-z]+ +)+(?![{SPACE_CHARS}])")  # plain words, each followed by spaces
_SIMPLE_LINE = re.compile(" *([A-Za-z]+(?: +[A-Za-z]+)*) *(\\.?) *(\\n|$)")  # words, maybe a final period


def _simple_line(text: str, pos: int) -> tuple[list[str], int, bool] | None:
    """The tokens of a line of plain words (maybe ending in a period) starting at ``pos``, where
    the next line starts, and whether there is one; None for any other line."""
    m = _SIMPLE_LINE.match(text, pos)
    if m is None:
        return None
    words = m.group(1).split()
    if _HAS_SPLIT_WORD.search(m.group(1)):
        return None
    if m.group(2):
        if _is_abbreviation(words[-1]):
            return None
        words.append(".")
    return words, m.end(), bool(m.group(3))


@functools.lru_cache(maxsize=4096)
def _is_abbreviation(word: str) -> bool:
    return _abbreviation().fullmatch(word + ".") is not None


@functools.cache
def _abbreviation() -> re.Pattern:
    return re.compile(f"{ABBREV1}|{ABBREV2}|{ABBREV3}")


def _plain_token(text: str, pos: int) -> str | None:
    m = _PLAIN.match(text, pos)
    if m is None:
        return None
    w = m.group(1)
    if w is None:
        return m.group(2)
    if w.lower() in _SPLIT_WORDS:
        return None
    if text.startswith(".", m.end()) and _is_abbreviation(w):
        return None
    return w


def tokenize_lines(lines: list[str], dispatch: bool = True) -> list[list[str]]:
    """PTB tokens of each line, as the jar gives them for the lines joined by newlines, with no
    newline after the last (as coco-caption writes them), before lower-casing. Lines must hold no
    line breaks of their own. ``dispatch=False`` tries every rule at every position (slow; it
    checks the shortcuts)."""
    if not lines:
        return []
    text = "\n".join(lines)
    astral = _ASTRAL.search(text) is not None
    if astral:
        text = _ASTRAL.sub(lambda m: _surrogates(m.group()), text)
    out: list[list[str]] = [[]]
    pos, n = 0, len(text)
    while pos < n:
        c = text[pos]
        if c == "\n":
            out.append([])
            pos += 1
            continue
        if dispatch and c in " \t":  # spaces: no rule but the space rule starts with one
            pos = _SPACES.match(text, pos).end()
            continue
        if dispatch and (pos == 0 or text[pos - 1] == "\n"):
            line = _simple_line(text, pos)
            if line is not None:
                out[-1].extend(line[0])
                if line[2]:
                    out.append([])
                pos = line[1]
                continue
        if dispatch:
            m = _RUN.match(text, pos)
            if m is not None:
                run = m.group()
                if not _HAS_SPLIT_WORD.search(run):
                    out[-1].extend(run.split())
                    pos = m.end()
                    continue
            tok = _plain_token(text, pos)
            if tok is not None:
                out[-1].append(tok)
                pos += len(tok)
                continue
        got = _longest(text, pos, _candidates(c) if dispatch else RULES)
        if got is None:  # a character no rule knows: the jar drops the ones it cannot tokenize
            if not _DELETED.match(c):
                out[-1].append(c)
            pos += 1
            continue
        rule, tok = got
        res = rule.action(tok)
        if isinstance(res, tuple):
            res, used = res
        else:
            used = len(tok)
        if res:
            out[-1].append(res)
        pos += used
    if astral:
        out = [[_from_utf16_units(t) for t in toks] for toks in out]
    return out
