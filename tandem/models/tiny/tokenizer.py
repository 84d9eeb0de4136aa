"""A small, deterministic byte-level BPE tokenizer for Tandem's tiny Qwen-shaped models.

There is no model hub to download a tokenizer from, so one is trained in-process on a corpus
generated from templates of the built-in RL tasks (arithmetic, countdown, GSM8K-style word
problems, think/answer formats) plus plain English. Byte-level BPE means any UTF-8 text encodes
without unknown tokens; digits are isolated one per token (as in Qwen) so arithmetic stays learnable.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Atomic (never split) but not special: they survive skip_special_tokens=True in decode.
ATOMIC_TOKENS = ("<think>", "</think>")

# 256 byte tokens + 5 added tokens + at least 59 merges, so the tokenizer compresses at all.
MIN_VOCAB_SIZE = 320
# The generated corpus supports ~21k tokens at this maximum; past it the trainer could undershoot.
MAX_VOCAB_SIZE = 16384

# Contractions, optionally space-led letter runs, single digits, optionally space-led punctuation
# runs, then whitespace (trailing runs keep their last space for the next word).
_SPLIT_PATTERN = r"'(?i:[sdmt]|ll|ve|re)| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# ChatML turns. With `tools=[...]` the template adds Qwen's tool-call format (what Qwen2.5/Qwen3
# templates render, so one parser serves both): the tools as one JSON line each in the system turn
# (a compact header of our own, made or extended there), an assistant's tool calls after its content
# as '\n<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>' (arguments: a dict through
# `tojson`, whose spacing is json.dumps's default, or a JSON string as is), and tool results as
# '<tool_response>' blocks inside one user turn per run of consecutive tool messages. Conversations
# without tools, tool calls or tool messages render exactly as plain ChatML did before.
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is not none and content is iterable and content is not mapping -%}"
    "{%- for part in content -%}{%- if part is mapping and part.text is defined -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{- text(messages[0]['content']) + '\\n\\n' -}}{%- endif -%}"
    "{{- 'Tools:\\n<tools>' -}}"
    "{%- for tool in tools -%}"
    "{{- '\\n' + ((tool.function if tool.function is defined else tool) | tojson) -}}"
    "{%- endfor -%}"
    "{{- '\\n</tools>\\nCall one as <tool_call>\\n{\"name\": ..., \"arguments\": {...}}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and loop.first and tools -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{%- set content = text(message['content']) -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content -}}"
    "{%- for call in (message['tool_calls'] or []) -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' -}}"
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _words(text: str) -> list[str]:  # keeps the long word lists below compact
    return text.split()


# fmt: off
_NAMES = ["Ava", "Ben", "Carla", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Luis",
          "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe"]
_ITEMS = ["apples", "pencils", "books", "cookies", "marbles", "stickers", "eggs", "cupcakes", "shirts", "tickets",
          "flowers", "toys", "candles", "bottles", "cards", "oranges", "notebooks", "muffins", "plants", "boxes"]
_PLACES = ["the store", "the market", "school", "the bakery", "the park", "the library", "the farm", "the fair"]
_NOUNS = _words("""time year people way day man woman child world school family student group country problem hand
place week company system question work number night point home water room mother money story month book job word
business side head house friend father power hour game line member car city name team minute idea body parent face
level office door person art history party result morning reason girl moment teacher force foot boy age music market
class field role heart leader light voice price report son town road value building season player paper space ground
event center project star table street picture piece land product doctor wall worker news test movie support step
baby computer film tree window daughter garden river island mountain forest ocean village kitchen bridge train
basket bicycle engine letter journey holiday language science animal summer winter weather recipe farmer museum""")
_VERBS = _words("""be have do say go get make know think take see come want look use find give tell work call try ask
need feel become leave put keep begin help talk turn start show hear play run move like live hold bring happen write
sit stand lose pay meet set learn change understand watch follow stop speak read add spend grow open walk win offer
remember consider buy wait send build stay fall cut reach sell decide return explain carry break receive agree eat
catch draw choose travel count divide multiply subtract measure compare repair paint borrow notice finish answer
describe discover collect prepare deliver visit clean plant cook wash climb solve check guess""")
_ADJECTIVES = _words("""good new first last long great little other old right big high different small large next
early young important few public bad same able late hard whole free true full special easy clear certain open red
difficult short single wrong fine common poor natural similar hot happy serious ready simple blue dark various final
main green nice huge popular quiet careful bright warm gentle brave honest curious patient proud quick slow strange""")
_GRADABLE = _words("""big small old young long short hard easy strong weak warm cold dark bright quick slow tall heavy
busy kind loud rich wide deep fresh soft quiet happy simple clever gentle brave proud""")
_FUNCTION = _words("""the a an this that these those every each some many several most no any its their our his her
my your and but or so because although while when after before until since if unless as than then also still just
only even very quite rather almost always never often sometimes usually in on at by for with from into over under
between through during without within about against across around behind beyond near toward upon""")
_SYLLABLES = _words("ka lo mi ren sa tor vel an dri el fon gu hal is jor ku lin mar nor ob pel qua ros sten ti ul var "
                    "wyn xe zan bel cor da fen gri ho ju ley mo pra")
_IRREGULAR_PAST = {"be": "was", "have": "had", "do": "did", "say": "said", "go": "went", "get": "got", "make": "made",
                   "know": "knew", "think": "thought", "take": "took", "see": "saw", "come": "came", "give": "gave",
                   "tell": "told", "find": "found", "feel": "felt", "leave": "left", "put": "put", "mean": "meant",
                   "keep": "kept", "begin": "began", "hold": "held", "bring": "brought", "write": "wrote",
                   "sit": "sat", "stand": "stood", "lose": "lost", "pay": "paid", "meet": "met", "set": "set",
                   "lead": "led", "read": "read", "spend": "spent", "grow": "grew", "win": "won", "buy": "bought",
                   "build": "built", "fall": "fell", "cut": "cut", "sell": "sold", "send": "sent", "run": "ran",
                   "speak": "spoke", "understand": "understood", "break": "broke", "eat": "ate", "catch": "caught",
                   "draw": "drew", "choose": "chose", "hit": "hit", "become": "became", "let": "let"}
# fmt: on


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(1, 999)
    op, result = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
    prompt = rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.", f"Calculate {a} {op} {b}."])
    reply = rng.choice([f"\\boxed{{{result}}}", f"<answer>{result}</answer>", f"The answer is {result}."])
    return f"{prompt} Put your final answer in \\boxed{{}}.\n<think>\n{a} {op} {b} = {result}\n</think>\n{reply}"


def _countdown(rng: random.Random) -> str:
    nums = sorted(rng.sample([*range(1, 11), 25, 50, 75, 100], 4))
    x, y = rng.sample(nums, 2)
    target = rng.randint(10, 999)
    return (
        f"Using the numbers {', '.join(map(str, nums))} and each at most once, reach {target} with + - * /. "
        "Show your work in <think> </think> tags and return the final equation in <answer> </answer> tags.\n"
        f"<think>\n{x} * {y} = {x * y}, {x * y} - {target} = {x * y - target}. Let me try another order.\n</think>\n"
        f"<answer>({x} * {y}) - ({x} + {y})</answer>"
    )


def _word_problem(rng: random.Random) -> str:
    name, other = rng.sample(_NAMES, 2)
    item, place = rng.choice(_ITEMS), rng.choice(_PLACES)
    n, k, price, pct = rng.randint(2, 60) * 2, rng.randint(2, 9), rng.randint(1, 40), rng.choice([10, 20, 25, 50])
    total, half = n * price, n // 2
    off = f"{total * pct / 100:g}"
    sale = f"{total - total * pct / 100:g}"
    templates = [
        (f"{name} buys {n} {item} at {place} for ${price} each. How much does {name} spend?",
         f"{name} spends {n}*{price} = <<{n}*{price}={total}>>{total} dollars.\n#### {total}"),
        (f"{name} had {n} {item} and gave half of them to {other}. Then {name} bought {k} more. "
         f"How many {item} does {name} have now?",
         f"After giving half away, {name} has {n}/2 = <<{n}/2={half}>>{half} {item}.\n"
         f"Then {name} has {half}+{k} = <<{half}+{k}={half + k}>>{half + k} {item}.\n#### {half + k}"),
        (f"A jacket costs ${total}. It is on sale for {pct}% off. What is the sale price?",
         f"The discount is {total}*{pct}/100 = <<{total}*{pct}/100={off}>>{off} dollars.\n"
         f"The sale price is {total}-{off} = ${sale}.\n#### {sale}"),
        (f"{name} reads {k} pages every day. How many pages will {name} read in {n} days?",
         f"{name} reads {k}*{n} = <<{k}*{n}={k * n}>>{k * n} pages.\n#### {k * n}"),
    ]
    question, answer = rng.choice(templates)
    return f"{question}\n{answer}"


_IRREGULAR_PLURAL = {"man": "men", "woman": "women", "child": "children", "person": "people", "foot": "feet"}
_DOUBLED = {"stop", "big", "hot", "sit", "run", "win", "plan", "cut", "hit", "put", "set", "let", "begin"}


def _suffix(word: str, suffix: str) -> str:
    """Attach an -s/-ed/-ing/-er/-est/-ly suffix with the common English spelling rules."""
    if suffix == "s":
        if word.endswith(("s", "x", "ch", "sh", "o")):
            return word + "es"
        return word[:-1] + "ies" if word[-1] == "y" and word[-2] not in "aeiou" else word + "s"
    if suffix == "ly":
        if word.endswith(("y", "le")):  # happy -> happily, gentle -> gently
            return word[:-1] + ("ily" if word.endswith("y") else "y")
        return word + "ly"
    if word in _DOUBLED:
        return word + word[-1] + suffix
    if word.endswith("e") and word != "be":
        if suffix == "ing" and word.endswith(("ie", "ee")):
            return word[:-2] + "ying" if word.endswith("ie") else word + suffix
        return word[:-1] + suffix
    if word.endswith("y") and word[-2] not in "aeiou" and suffix != "ing":
        return word[:-1] + "i" + suffix
    return word + suffix


def _english(rng: random.Random) -> str:
    def noun(plural: bool = False) -> str:
        n = rng.choice(_NOUNS)
        return (_IRREGULAR_PLURAL.get(n) or _suffix(n, "s")) if plural else n

    def verb(form: str = "") -> str:
        v = rng.choice(_VERBS)
        if form == "ed":
            return _IRREGULAR_PAST.get(v) or _suffix(v, "ed")
        if form == "s":
            return {"be": "is", "have": "has"}.get(v) or _suffix(v, "s")
        return _suffix(v, form) if form else v

    def adj(form: str = "") -> str:
        return _suffix(rng.choice(_GRADABLE), form) if form else rng.choice(_ADJECTIVES)

    def word() -> str:
        return rng.choice(_FUNCTION)

    sentences = [
        f"{word()} {adj()} {noun()} {verb('ed')} {word()} {noun(True)} {word()} the {noun()}.",
        f"{rng.choice(_NAMES)} {adj('ly')} {verb('s')} the {adj()} {noun()}, {word()} the {noun()} is {adj()}.",
        f"Why did the {noun()} {verb()} {word()} {adj()} {noun(True)}?",
        f"We were {verb('ing')} {word()} the {noun()} when it started to {verb()}, and they'd never {verb('ed')} it.",
        f"The {noun(True)} are {adj('er')} than the {noun()}, but the {adj('est')} one isn't {adj()} here.",
        f"I'm sure you've {verb('ed')} {word()} {noun(True)} {word()} {noun()}; it's {adj()} {word()} {adj()}!",
    ]
    return " ".join(s[0].upper() + s[1:] for s in rng.sample(sentences, rng.randint(1, 3)))


def _made_up_names(rng: random.Random, n_names: int) -> Iterator[str]:
    """Lines about invented people and places: the long tail of rare words that big vocabularies need."""
    pool = sorted({"".join(rng.choices(_SYLLABLES, k=rng.randint(2, 4))).capitalize() for _ in range(n_names)})
    for _ in range(n_names * 3 // 4):  # ~3 uses per name, enough for min_frequency=2
        a, b, c, d = rng.sample(pool, 4)
        yield f"{a} drove {rng.randint(2, 90)} miles from {b} to {c} to visit {d}."


def _corpus(vocab_size: int, seed: int = 0) -> Iterator[str]:
    # A fixed seed and call order make the corpus, hence the merges, reproducible. Task lines come
    # first and dominate the pair counts, so small vocabularies spend their merges on task text.
    rng = random.Random(seed)
    families = (_arithmetic, _countdown, _word_problem)
    for i in range(3000):
        yield families[i % len(families)](rng)
    for _ in range(600):
        yield _english(rng)
    yield from _made_up_names(rng, vocab_size)


def build_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with exactly ``vocab_size`` tokens (specials included)."""
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be between {MIN_VOCAB_SIZE} and {MAX_VOCAB_SIZE}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps offsets exact; a non-None post-processor also stops transformers installing its own.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ATOMIC_TOKENS),  # the atomic tokens are appended after training
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(vocab_size), trainer)
    tok.add_tokens([AddedToken(t, single_word=False, normalized=False, special=False) for t in ATOMIC_TOKENS])
    if tok.get_vocab_size() != vocab_size:  # the corpus ran out of pairs with count >= min_frequency
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, wanted vocab_size={vocab_size}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        model_max_length=4096,
        padding_side="right",
        clean_up_tokenization_spaces=False,  # decode must return the exact text
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and the chat template for ``AutoTokenizer``."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))


def special_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int | None]:
    """Ids for model configs: eos is ``<|im_end|>``, pad ``<|endoftext|>``, and there is no bos (Qwen)."""
    eos, pad, im_start = (tokenizer.convert_tokens_to_ids(t) for t in (IM_END, ENDOFTEXT, IM_START))
    return {"eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None, "im_start_token_id": im_start}
