"""Tokens and targets as people read and write them: readable token texts in every record, targets read after the
prompt (' Paris' for "Paris"), each target's probability, and the note when the embedding norms are flat.

A byte-level BPE tokenizer trained in tests/bpe_tiny.py gives real 'Ġ' pieces, newline tokens and words that are
one token with and without a leading space. Numbers are checked against the oracle (the model's own logits and
``output_hidden_states=True`` with the head by hand).
"""

import json
import re
import unicodedata

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import BertTokenizerFast, PreTrainedTokenizerFast

import bpe_tiny
import nxl_hooks as nxl
import oracle
import tiny
from nxl_hooks.apps.options import parse_target
from nxl_hooks.records.tokens import chat_text, readable, readable_ids, visible

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tok():
    return bpe_tiny.bpe_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return bpe_tiny.bpe_llama(tok)


def piece_id(tok, piece: str) -> int:
    return tok.convert_tokens_to_ids(piece)


def oracle_scores(model, tok, text: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(NormXLogit (L+1, seq, k), the model's own softmax probability (k,)) of ``ids`` after ``text``."""
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
    logits = oracle.llama(model).layer_logits(out.hidden_states)
    scores = torch.stack([oracle.normxlogit(logits, out.hidden_states[0], torch.tensor([i]))[1][:, 0] for i in ids], -1)
    return scores, out.logits[0, -1].softmax(-1)[ids]


def forced_generation(tok, prompt: torch.Tensor, emitted: list[int], **options):
    """A random tiny Llama over ``tok``'s vocabulary made to generate ``emitted`` after ``prompt`` (1, n), recorded
    (``options``: attach's, a sink): (the recorded call, generate's output)."""
    from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

    class Emit(LogitsProcessor):  # the test's tokens, one per step
        def __call__(self, input_ids, scores):
            forced = torch.full_like(scores, float("-inf"))
            forced[:, emitted[input_ids.shape[1] - prompt.shape[1]]] = 0
            return forced

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
    with torch.no_grad(), nxl.attach(model, tokenizer=tok, **options) as probe:
        out = model.generate(prompt, max_new_tokens=len(emitted), do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([Emit()]))
    assert out[0, prompt.shape[1]:].tolist() == emitted
    return probe.calls[-1], out


def test_visible_marks_edge_spaces_newlines_and_invisible_characters():
    assert visible(" Paris") == "␣Paris" and visible("  ") == "␣␣" and visible(" a b ") == "␣a b␣"
    assert visible("\n\n") == "↵↵" and visible("\t") == "⇥" and visible("") == "∅"
    assert visible("\x1b[31mred") == "\\x1b[31mred"  # an ANSI escape never reaches a terminal raw
    assert visible("\u202eevil") == "\\u202eevil" and visible("a\u200bb") == "a\\u200bb"


def test_a_backslash_is_escaped_so_a_tokens_own_escape_text_reads_back_as_written():
    """Source code holds tokens such as '\\x41' and '\\xe9': their readable texts could not be told from the byte and
    character escapes of visible(), so a call's text read them as 'A' and '�' (and the step view as '…')."""
    from nxl_hooks.records.tokens import plain_text, whole_characters

    words = [*tiny.VOCAB, "\\x41", "\\xe9", "a\\\\b"]
    tok = tiny.word_tokenizer(words)
    emitted = [words.index("\\xe9"), words.index("\\x41"), words.index("a\\\\b")]
    assert visible("\\x41") == "\\\\x41" and visible("a\\\\b") == "a\\\\\\\\b"
    assert readable_ids(tok, emitted) == ["\\\\xe9", "\\\\x41", "a\\\\\\\\b"]
    assert plain_text(["\\xe9", "\\x41"]) == "\ufffdA"  # older texts, backslashes unescaped, read as before

    call, _ = forced_generation(tok, tok("the film was", return_tensors="pt")["input_ids"], emitted)
    assert call.text == tok.decode(emitted) == "\\xe9 \\x41 a\\\\b"  # (a word-level tokenizer: spaced)
    assert [step.view(call).token for step in call.steps] == ["\\\\xe9", "\\\\x41", "a\\\\\\\\b"]
    assert whole_characters(call.readable[0] + [step.readable[0] for step in call.steps]) == (
        call.readable[0] + ["\\\\xe9", "\\\\x41", "a\\\\\\\\b"])


def test_a_target_is_named_by_its_readable_text_quoted_as_it_is():
    """The header and repr quote a target's readable text as it is: '\\x41' (a token whose text is backslash, x,
    4, 1) and '\x1b' (the escape character) stay apart there as in the tables (repr doubled every backslash)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    words = [*tiny.VOCAB, "\\x41", "\x1b"]
    tok = tiny.word_tokenizer(words)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
    for word in words[-2:]:
        res = nxl.explain(model, tok, "the film was", target=words.index(word))
        shown = visible(word)
        assert res.target_label().startswith(f"'{shown}' (id {words.index(word)}")
        assert f"'{shown}'" in repr(res) and f"'{shown}'".replace("\\", "\\\\") not in repr(res)


def test_readable_tokens_of_a_byte_level_bpe(tok):
    ids = tok("The capital of France is Paris.\nThe 😀 a\x1bb")["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[:8] == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis", "ĠParis", ".", "Ċ"]
    emoji = [f"\\x{byte:02x}" for byte in "😀".encode()]  # not in the training text: one token per byte
    assert readable_ids(tok, ids) == ["The", "␣capital", "␣of", "␣France", "␣is", "␣Paris", ".", "↵", "The", "␣",
                                      *emoji, "␣a", "\\x1b", "b"]
    assert readable(tok, piece_id(tok, "ĠParis")) == "␣Paris" and readable(tok, piece_id(tok, "Paris")) == "Paris"
    every = readable_ids(tok, range(len(tok)))  # no control or format character in any token's text
    assert not [t for t in every if any(unicodedata.category(c) in ("Cc", "Cf") for c in t)]


def test_sentencepiece_pieces_keep_their_space_when_decoded_alone():
    backend = Tokenizer(models.WordLevel({"▁Paris": 0, "Paris": 1, "<unk>": 2, "<0x0A>": 3}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Strip(" ", 1, 0)])
    sp = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert sp.decode([0]) == "Paris"  # the decoder drops a first token's space...
    assert readable_ids(sp, [0, 1, 3]) == ["␣Paris", "Paris", "↵"]  # ...the readable text keeps it


def test_a_sentencepiece_run_of_spaces_keeps_every_space():
    """Llama-2 / Mistral pieces of several '▁' (code's indent, '▁▁▁▁') decode alone to one space fewer: such a token
    read '␣␣␣' and a generated function's text lost a space of each indent. The oracle: transformers' own Llama
    tokenizer decoding each token after a word, and a streamer's view (the whole sequence decoded, the prompt cut)."""
    from transformers import LlamaTokenizer

    from nxl_hooks.records.tokens import plain_text

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "▁▁": 4, "▁▁▁▁": 5, "▁return": 6, "<0x0A>": 7, "▁x": 8, "x": 9}
    sp = LlamaTokenizer(vocab=vocab, merges=[("▁", "▁"), ("▁▁", "▁▁")])
    prompt = sp("x", return_tensors="pt")["input_ids"]
    emitted = [vocab[piece] for piece in ("<0x0A>", "▁▁▁▁", "▁return", "▁x", "<0x0A>", "▁▁", "x")]
    word = sp.decode([vocab["x"]])
    for token in range(3, len(vocab)):
        decoded = sp.decode([vocab["x"], token])[len(word):]
        assert readable(sp, token) == visible(decoded), sp.convert_ids_to_tokens(token)

    call, out = forced_generation(sp, prompt, emitted)
    streamed = sp.decode(out[0], skip_special_tokens=True)[len(sp.decode(prompt[0], skip_special_tokens=True)):]
    assert call.text == streamed == "\n     return x\n  x"  # 4 + 1 spaces, then 2
    assert plain_text(readable_ids(sp, prompt[0])) == " x"  # a prompt's first '▁' keeps its space, as documented


def byte_level_tokenizer(merges: list[tuple[str, str]]):
    """transformers' own GPT-2 tokenizer over the byte alphabet and ``merges`` (pairs of byte-level pieces)."""
    from tokenizers import pre_tokenizers
    from transformers import GPT2Tokenizer

    vocab = {"<|endoftext|>": 0, **{char: i + 1 for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}}
    vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
    return GPT2Tokenizer(vocab=vocab, merges=merges)


def test_a_byte_level_piece_of_whole_characters_reads_as_them_a_replacement_character_included():
    """GPT-2's pieces 'ï¿½' and 'Ġï¿½' are a '�' of the text's own (mojibake in scraped data), whole: they read
    '\\xef\\xbf\\xbd' and '\\x20\\xef\\xbf\\xbd' in every table, page and export, as if each held part of a character.
    The oracle: transformers' own GPT-2 tokenizer, its decode of each id and of the generated ids."""
    from nxl_hooks.records.tokens import plain_text, whole_characters

    gpt2 = byte_level_tokenizer([("ï", "¿"), ("ï¿", "½"), ("Ġ", "ï¿½"), ("ð", "Ł")])
    ids = gpt2("caf\ufffd \ufffd😀")["input_ids"]
    assert gpt2.convert_ids_to_tokens(ids) == ["c", "a", "f", "ï¿½", "Ġï¿½", "ðŁ", "ĺ", "Ģ"]
    names = readable_ids(gpt2, ids)
    assert names[3:5] == [visible(gpt2.decode([i])) for i in ids[3:5]] == ["�", "␣�"]
    assert names[5:] == ["\\xf0\\x9f", "\\x98", "\\x80"]  # parts of a character still show their bytes
    assert whole_characters(names)[3:] == ["�", "␣�", "😀", "😀", "😀"] and plain_text(names) == gpt2.decode(ids)
    call, out = forced_generation(gpt2, torch.tensor([ids[:3]]), ids[3:])
    assert [step.readable[0] for step in call.steps] == names[3:]
    assert call.text == gpt2.decode(out[0, 3:]) == "\ufffd \ufffd😀"



def test_a_token_of_a_c1_control_or_soft_hyphen_reads_back_as_that_character_not_a_byte():
    """A token whose text is NEL (U+0085), a C1 control (U+009D) or a soft hyphen (U+00AD, common in web text) read
    '\\x85', '\\x9d', '\\xad': the bytes of a byte-level piece, so call.text and plain_text made '�' of each (and after
    a split emoji, another character). Such a text reads '\\u0085' now. The oracle: the GPT-2 tokenizer's decode."""
    from tokenizers import pre_tokenizers

    from nxl_hooks.records.tokens import plain_text, whole_characters

    chars = "\x85\x9d\xad"
    pieces = [pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(c)[0][0] for c in chars]
    gpt2 = byte_level_tokenizer([(piece[0], piece[1]) for piece in pieces] + [("ð", "Ł"), ("ðŁ", "ĺ")])
    ids = gpt2("a\x85b\x9d\xad😀\x85")["input_ids"]
    assert len(ids) == 8 and gpt2.convert_ids_to_tokens(ids)[1] == pieces[0]  # each character one token
    names = readable_ids(gpt2, ids)
    assert names == ["a", "\\u0085", "b", "\\u009d", "\\u00ad", "\\xf0\\x9f\\x98", "\\x80", "\\u0085"]
    assert plain_text(names) == gpt2.decode(ids) and plain_text(names[-1:]) == gpt2.decode(ids[-1:]) == "\x85"
    assert whole_characters(names)[5:] == ["😀", "😀", "\\u0085"]
    call, out = forced_generation(gpt2, torch.tensor([ids[:1]]), ids[1:])
    assert call.text == gpt2.decode(out[0, 1:]) == "\x85b\x9d\xad😀\x85"
    assert [step.view(call).token for step in call.steps][-1] == "\\u0085"


def test_a_word_level_tokenizer_without_a_decoder_keeps_the_spaces_its_decode_puts_between_words(tmp_path):
    """A word-level tokenizer without a decoder decodes each token alone to its bare word and joins them with a
    space: call.texts ran them together ('moviefilmis'). They read as the tokenizer's own decode and
    convert_tokens_to_string, live and read back from the stream file; a byte-level one still joins with nothing."""
    words = tiny.word_tokenizer(tiny.VOCAB)
    assert words.backend_tokenizer.decoder is None
    prompt = words("the movie was", return_tensors="pt").input_ids
    emitted = words.convert_tokens_to_ids(["very", "good", "and", "the", "plot", "is", "great"])
    call, out = forced_generation(words, prompt, emitted, sink=tmp_path / "run.nxl")
    (back,) = nxl.read_stream(tmp_path / "run.nxl")
    expected = words.decode(out[0, prompt.shape[1]:])
    assert expected == words.convert_tokens_to_string(words.convert_ids_to_tokens(emitted))
    assert expected == "very good and the plot is great"
    assert call.texts == back.texts == [expected]
    gpt2 = bpe_tiny.bpe_tokenizer()  # its pieces carry their spaces: nothing between them
    ids = gpt2(" the capital of France", add_special_tokens=False)["input_ids"]
    call, out = forced_generation(gpt2, torch.tensor([ids[:1]]), ids[1:])
    assert call.text == gpt2.decode(out[0, 1:]) == " capital of France"


@pytest.mark.parametrize(("cleanup", "spaces"), [(True, False), (False, False), (True, True)],
                         ids=["decoder-cleanup", "no-cleanup", "clean_up_tokenization_spaces"])
def test_wordpiece_call_texts_read_as_the_tokenizers_decode(tmp_path, cleanup, spaces):
    """A WordPiece tokenizer's decode joins a '##' piece to the word before it without its prefix and puts a space
    before any other token (then cleans up ' .' to '.'): call.texts read its pieces as written ('the##ing' and
    'catsat' where decode gives 'theing cat sat'). They read as the tokenizer's own decode, live and read back from
    the stream file, also where clean_up_tokenization_spaces cleans up the text it joined ("on ' s" to "on's", as a
    tokenizer saved by transformers 4 often asks); each token's own text keeps its prefix, as decoded alone."""
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "##ing", "##s", ".", ",", "?", "!",
             "'", "s", "'s", "n't", "'m", "on", "mat"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    tok = BertTokenizerFast(str(tmp_path / "vocab.txt"), do_lower_case=True)
    tok.backend_tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=cleanup)
    tok.clean_up_tokenization_spaces = spaces
    prompt = tok("the cat", add_special_tokens=False, return_tensors="pt").input_ids
    emitted = tok.convert_tokens_to_ids(["cat", "##s", "sat", "##ing", ".", "on", "'", "s", "mat", "'s", "n't", "?",
                                         "!", ",", "the", "'m", "[SEP]", "##s"])
    call, out = forced_generation(tok, prompt, emitted, sink=tmp_path / "run.nxl")
    (back,) = nxl.read_stream(tmp_path / "run.nxl")
    expected = tok.decode(out[0, prompt.shape[1]:])
    # the decode the test compares to
    assert "cats sating" in expected and ("sating." in expected) is cleanup and ("on's" in expected) is spaces
    assert call.texts == back.texts == [expected]
    assert [step.readable[0] for step in call.steps][:4] == ["cat", "##s", "sat", "##ing"]
    if spaces:  # a BPE tokenizer's text transformers 5 leaves as it is, whatever it asks (and says so)
        gpt2 = bpe_tiny.bpe_tokenizer()
        gpt2.clean_up_tokenization_spaces = True
        ids = gpt2(" Paris is a city , we are what we are .", add_special_tokens=False)["input_ids"]
        call, out = forced_generation(gpt2, torch.tensor([ids[:1]]), ids[1:])
        assert call.text == gpt2.decode(out[0, 1:]) == " is a city , we are what we are ."


def test_word_targets_are_the_token_the_model_would_emit_after_the_prompt(model, tok):
    paris, bare = piece_id(tok, "ĠParis"), piece_id(tok, "Paris")
    assert paris != bare
    for request in ("Paris", " Paris", "ĠParis", paris):
        res = nxl.explain(model, tok, PROMPT, target=request)
        assert int(res.target[0]) == paris and res.target_text == [["␣Paris"]], request
    after_newline = nxl.explain(model, tok, "The capital of France is\n", target="Paris")
    assert int(after_newline.target[0]) == bare  # no space is added after whitespace
    period = nxl.explain(model, tok, PROMPT + " Paris", target=".")
    assert int(period.target[0]) == piece_id(tok, ".")  # nor before punctuation
    res = nxl.explain(model, tok, PROMPT, target=parse_target(" are, is"), layers="all")
    are, is_ = piece_id(tok, "Ġare"), piece_id(tok, "Ġis")
    assert res.target.tolist() == [[are, is_]] and res.target_text == [["␣are", "␣is"]]
    expected, probability = oracle_scores(model, tok, PROMPT, [are, is_])
    torch.testing.assert_close(res.normxlogit[:, 0], expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(res.probability[0], probability, rtol=1e-4, atol=1e-7)
    assert res.target_label(0, 0) == f"' are' -> '␣are' (id {are}, p {float(probability[0]):.3g})"


def test_only_ascii_digits_are_an_id_other_digits_are_words(model, tok):
    """str.isdigit() holds for '²' (int() refuses it: --target failed) and '٣' (Arabic-Indic three: it explained
    id 3)."""
    assert parse_target("٣") == "٣" and parse_target("²,-3") == ["²", -3] and parse_target("--3") == "--3"
    for word in ("٣", "²"):
        res = nxl.explain(model, tok, PROMPT, target=parse_target(word))
        note = res.meta["targets"][0][0]
        first = note["tokens"][0]
        assert note["request"] == word and note["how"] in ("word", "token") and int(res.target[0]) == first != 3
        expected, _ = oracle_scores(model, tok, PROMPT, [first])
        torch.testing.assert_close(res.normxlogit[:, 0], expected[..., 0], rtol=1e-4, atol=1e-5)
    classifier, words = tiny.build_model("bert", 0), tiny.tokenizer()
    with pytest.raises(ValueError, match="not one of the model's labels"):  # not label 1
        nxl.explain(classifier, words, "the film was good", target="١")


def test_a_word_of_several_tokens_explains_the_first_and_says_so(model, tok):
    res = nxl.explain(model, tok, PROMPT, target="Parisians")
    assert tok.convert_ids_to_tokens(res.meta["targets"][0][0]["tokens"])[0] == "ĠParis"
    assert int(res.target[0]) == piece_id(tok, "ĠParis")
    note = res.meta["targets"][0][0]["note"]
    assert "'Parisians' is 4 tokens here" in note and "only the first, ␣Paris, is explained" in note
    # said where the target is named too (the repr, views, HTML): it was only in meta's note
    assert res.target_label().startswith("'Parisians' -> '␣Paris' (id ") and "the first of its 4 tokens)" in repr(res)
    assert "tokens)" not in nxl.explain(model, tok, PROMPT, target="Paris").target_label()
    # attach has no prompt to read the word after: refused, its tokens named as every output shows them (they were
    # the raw pieces ['ĠParis', ...]); the piece is offered as what a target may name
    ids = tok.encode(" Parisians", add_special_tokens=False)
    texts = [visible(tok.decode([i])) for i in ids]  # the tokenizer's own decoding, made visible
    assert texts[0] == "␣Paris" and len(ids) > 1
    with pytest.raises(ValueError, match=re.escape(
            f"target ' Parisians' is {len(ids)} tokens ({' '.join(texts)}): attach explains one token; pass one "
            f"(here the first, ␣Paris: id {piece_id(tok, 'ĠParis')} or its piece 'ĠParis')")):
        nxl.attach(model, tokenizer=tok, target=" Parisians")


def roberta_mlm(tok):
    """A random tiny RoBERTa masked LM over ``tok`` (:func:`bpe_tiny.roberta_tokenizer`)."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    torch.manual_seed(0)
    return RobertaForMaskedLM(RobertaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                                            pad_token_id=tok.pad_token_id)).eval()


def test_a_masked_lm_reads_a_word_at_its_mask_as_the_token_it_would_fill_in():
    """A masked LM's word target is the token its mask would be filled with, each mask its own: it was read after
    the whole text, one id for every mask (the word after '...at <mask>'). The oracle: the tokenizer's encoding of
    the text with the word written in place of each mask (a word's own leading space in place of the one RoBERTa's
    '<mask>' strips), read at the mask's position."""
    import re

    from nxl_hooks.eval import faithfulness as ev

    tok = bpe_tiny.roberta_tokenizer()
    model = roberta_mlm(tok)
    text = "The capital of France is <mask>. The city (<mask> is a city at <mask>"
    enc = tok(text, return_tensors="pt")
    masks = (enc["input_ids"][0] == tok.mask_token_id).nonzero().flatten()
    fills = {"Paris": text.replace("<mask>", "Paris"), " Paris": re.sub(r" ?<mask>", " Paris", text)}
    expected = []
    for word, filled in fills.items():
        ids = tok(filled)["input_ids"]
        assert len(ids) == enc["input_ids"].shape[1], word  # the word is one token in each place
        expected.append([ids[int(m)] for m in masks])
    expected = torch.tensor(expected).T  # (masks, words)
    bare, spaced = piece_id(tok, "Paris"), piece_id(tok, "ĠParis")
    assert expected.tolist() == [[spaced, spaced], [bare, spaced], [spaced, spaced]]  # never one id for all
    # one word a call: both in one list name one output twice at the first mask (and the last), which is refused
    with pytest.raises(ValueError, match=rf"^target list names output {spaced} twice in row 0 \('Paris' and ' Paris'"):
        nxl.explain(model, tok, text, target=list(fills))
    res, spaced_res = (nxl.explain(model, tok, text, target=[word]) for word in fills)
    assert res.position.tolist() == masks.tolist()
    assert torch.equal(torch.cat([res.target, spaced_res.target], 1), expected)
    assert [a + b for a, b in zip(res.target_text, spaced_res.target_text)] == [
        ["␣Paris", "␣Paris"], ["Paris", "␣Paris"], ["␣Paris", "␣Paris"]]
    assert res.resolution(1, 0)["text"] == "Paris" and res.resolution(2, 0)["text"] == "␣Paris"
    with torch.no_grad():
        probability = model(**enc).logits[0, masks].softmax(-1).gather(1, expected)
    torch.testing.assert_close(torch.cat([res.probability, spaced_res.probability], 1), probability, rtol=1e-4,
                               atol=1e-7)
    assert int(nxl.explain(model, tok, text, target="Paris").target[1]) == bare
    record = ev.score_example(model, tok, {"text": "The city (<mask> is", "target": "Paris"}, methods=["normxlogit"])
    assert record["target"] == bare


def test_a_word_at_a_mask_that_strips_its_space_keeps_that_space_after_a_bracket():
    """'( <mask>': RoBERTa's '<mask>' strips the space before it, so the word in its place is ' Paris' (the text
    reads '( Paris'); the space was dropped and the rule for a word after '(' (no space) gave 'Paris', another token.
    The oracle: the tokenizer's encoding of the text with the word written in place of each mask."""
    tok = bpe_tiny.roberta_tokenizer()
    model = roberta_mlm(tok)
    text = "The city ( <mask> is a city. (<mask> is"
    enc = tok(text)["input_ids"]
    masks = [i for i, id_ in enumerate(enc) if id_ == tok.mask_token_id]
    filled = tok(text.replace("<mask>", "Paris"))["input_ids"]
    assert len(filled) == len(enc)  # the word is one token in each place
    expected = [filled[m] for m in masks]
    assert expected == [piece_id(tok, "ĠParis"), piece_id(tok, "Paris")]
    res = nxl.explain(model, tok, text, target="Paris")
    assert res.position.tolist() == masks
    assert res.target.tolist() == expected


def test_a_wordpiece_continuation_piece_is_a_token_target(tmp_path):
    """'##ians', a WordPiece vocabulary entry (what tokenizer.tokenize('Parisians') shows), was read as a word and
    refused as 'not a single token in the vocabulary' (the text '##ians' is unknown tokens), though the refusal says
    to pass a token. It is that token now; the word 'Parisians' still explains its first piece where the mask is.
    The oracle: the tokenizer's own pieces, and its encoding of the text with the word written at the mask."""
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

    # '#' and 'ians' as words too (BERT's vocabulary has '#'): the text '##ians' then encodes without an unknown token
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "capital", "of", "france", "is", "paris", "##ians",
             ".", "#", "ians"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    tok = BertTokenizerFast(str(tmp_path / "vocab.txt"), do_lower_case=True)
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, max_position_embeddings=64)).eval()
    text = "The capital of France is [MASK]."
    mask = tok(text)["input_ids"].index(tok.mask_token_id)
    assert tok.tokenize("Parisians") == ["paris", "##ians"]
    res = nxl.explain(model, tok, text, target="##ians")
    assert res.target.tolist() == [tok.convert_tokens_to_ids("##ians")] and res.meta["targets"][0][0]["how"] == "token"
    word = nxl.explain(model, tok, text, target="Parisians")
    assert word.target.tolist() == [tok(text.replace("[MASK]", "Parisians"))["input_ids"][mask]]
    assert word.meta["targets"][0][0]["tokens"] == tok.convert_tokens_to_ids(["paris", "##ians"])


def test_classifier_probability_is_the_label_softmax():
    model, tok = tiny.build_model("bert", 0), tiny.tokenizer()
    res = nxl.explain(model, tok, ["the film was good", "bad plot"], target=["LABEL_1", " LABEL_0"])
    enc = tok(["the film was good", "bad plot"], return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = model(**enc).logits.softmax(-1)[:, [1, 0]]
    torch.testing.assert_close(res.probability, expected, rtol=1e-4, atol=1e-7)
    assert res.target_text == [["LABEL_1", "LABEL_0"]] * 2
    assert res.readable[0][:3] == ["[CLS]", "the", "film"]


def test_generate_steps_carry_probability_and_readable_tokens(model, tok, tmp_path):
    enc = tok(PROMPT, return_tensors="pt")
    with nxl.attach(model, tokenizer=tok, layers=[-1], sink=tmp_path / "run.nxl") as probe:
        out = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=2)
    call = probe.calls[0]
    assert call.readable == [readable_ids(tok, enc["input_ids"][0])]
    for step in call.steps:
        with torch.no_grad():  # the model's own distribution over the whole prefix, without a cache
            expected = model(out[:, : step.position]).logits[0, -1].softmax(-1)[step.token]
        torch.testing.assert_close(step.probability, expected, rtol=1e-4, atol=1e-7)
        assert step.readable == [readable(tok, int(step.token[0]))]
    (back,) = nxl.read_stream(tmp_path / "run.nxl")  # the stream file keeps both
    assert back.readable == call.readable
    for kept, read in zip(call.steps, back.steps):
        assert read.readable == kept.readable and torch.equal(read.probability, kept.probability)


def test_saved_files_keep_texts_and_old_files_still_load(model, tok, tmp_path):
    res = nxl.explain(model, tok, PROMPT + "\n", target="Paris")
    back = nxl.Attribution.load(res.save(tmp_path / "a.safetensors"))
    assert back.readable == res.readable and back.readable[0][-1] == "↵" and back.target_text == res.target_text
    assert torch.equal(back.input_ids, res.input_ids) and torch.equal(back.probability, res.probability)
    assert back.meta["targets"] == res.meta["targets"]
    # A file written before these fields: same tensors and header, without them.
    header = {"format": "nxl_hooks.attribution", "version": 1, "layers": res.layers, "tokens": res.tokens,
              "meta": {"head_kind": "causal_lm"}}
    tensors = {name: getattr(res, name).contiguous() for name in
               ("normxlogit", "logat", "embed_norm", "target", "mask", "position", "example")}
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata={"nxl_hooks": json.dumps(header)})
    old = nxl.Attribution.load(tmp_path / "old.safetensors")
    assert old.readable is None and old.probability is None and old.input_ids is None
    assert old.token_labels(0)[-1] == "Ċ" and old.target_info(0) == [
        {"id": int(res.target[0]), "text": None, "probability": None}]


def test_a_file_whose_texts_pass_safetensors_100_mb_header_bound_saves_and_loads(model, tok, tmp_path):
    """The readable texts go in the file's header (about 17 bytes a token and row in a long context), where
    safetensors' own save and load refuse more than 100 MB: such a result saves and reads back whole."""
    import dataclasses
    import struct

    res = nxl.explain(model, tok, PROMPT, target="Paris")
    width = res.mask.shape[1]
    # 15M characters, 7 bytes each in the header ('\\u00e9' in the JSON string the metadata holds): load checks each
    long = dataclasses.replace(res, readable=[["é" * (15_000_000 // width)] * width])
    path = long.save(tmp_path / "long.safetensors")
    with open(path, "rb") as fh:
        assert struct.unpack("<Q", fh.read(8))[0] > 100_000_000
    back = nxl.Attribution.load(path)
    assert back.readable == long.readable and back.tokens == res.tokens
    assert torch.equal(back.normxlogit, res.normxlogit) and torch.equal(back.input_ids, res.input_ids)


def test_chat_text_uses_the_template_and_never_doubles_bos(tok):
    text = chat_text(tok, "What is the capital of France?")
    assert text == "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="has no chat template"):
        chat_text(tiny.tokenizer(), "hi")
    from tokenizers import processors

    bos_tok = bpe_tiny.bpe_tokenizer()  # a tokenizer that adds its BOS itself, with a template that starts with it
    bos_tok.bos_token = "<|endoftext|>"
    bos_tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                                              special_tokens=[("<|endoftext|>", 0)])
    bos_tok.chat_template = "<|endoftext|>" + bpe_tiny.CHAT_TEMPLATE
    turns = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert bos_tok(chat_text(bos_tok, "hi"))["input_ids"] == [0] + bos_tok(turns, add_special_tokens=False)["input_ids"]


def test_flat_embedding_norms_are_said_once_and_rank_as_logat(tok, tmp_path):
    from rich.console import Console

    from nxl_hooks.apps.terminal import show_attribution
    from nxl_hooks.eval import faithfulness as ev
    from nxl_hooks.method.select import order

    flat = bpe_tiny.bpe_llama(tok, seed=1)
    with torch.no_grad():  # every embedding row scaled to the same norm, as models that normalize them
        weight = flat.model.embed_tokens.weight
        weight.mul_(3.0 / weight.norm(dim=-1, keepdim=True).clamp_min(1e-6))  # the pad row stays zero
    res = nxl.explain(flat, tok, PROMPT + " a city")
    assert res.norm_spread(0) < 1e-3
    eligible = res.rankable(0)
    for layer in range(len(res.layers)):
        assert torch.equal(order(res.normxlogit[layer, 0], eligible), order(res.logat[layer, 0], eligible))
    console = Console(record=True, width=100)
    show_attribution(res, console)
    assert " ".join(console.export_text().split()).count("NormXLogit ranks tokens exactly as LogAt does") == 1
    assert res.to_html().count("NormXLogit ranks tokens exactly as LogAt does") == 1
    record = ev.score_example(flat, tok, {"text": PROMPT, "target": "Paris"}, methods=["normxlogit"])
    assert record["flat_norms"] and record["norm_spread"] < 1e-3
    assert ev.aggregate([record, record])["flat_norms"] == 2

    plain = nxl.explain(bpe_tiny.bpe_llama(tok, seed=1), tok, PROMPT + " a city")  # the same model, unscaled
    assert plain.norm_spread(0) > 1e-2
    console = Console(record=True, width=100)
    show_attribution(plain, console)
    assert "LogAt does" not in console.export_text() and "LogAt does" not in plain.to_html()


def test_a_model_whose_outputs_overflow_is_said_to_have_no_prediction(tok):
    """A float16 model whose last block overflows: its logits are NaN, and the terminal and the page showed "NormXLogit
    of '<token 0>' (p nan)" as if that were its prediction, with no word of why. Both say it once now, with what to
    do; the same model in float32 says nothing of it."""
    from rich.console import Console

    from nxl_hooks.apps.terminal import show_attribution

    model = tiny.overflowing(bpe_tiny.bpe_llama(tok, seed=1))
    note = "outputs at the prediction position are NaN or infinite (an overflow, as in float16)"
    for dtype, said in ((torch.float16, 1), (torch.float32, 0)):
        res = nxl.explain(model.to(dtype), tok, PROMPT)
        with torch.no_grad():
            logits = model(**tok(PROMPT, return_tensors="pt")).logits[0, -1]
        assert bool(logits.isnan().any()) == bool(said)
        console = Console(record=True, width=100)
        show_attribution(res, console)
        assert " ".join(console.export_text().split()).count(note) == said
        assert res.to_html().count(note) == said
        assert res.overflowed() == bool(said)


def test_a_generation_whose_outputs_overflow_is_said_so_once(tok):
    """The same overflowing model generating: every step showed "p –" with its scores NaN, and neither the terminal
    nor the generation page said why; each says it once now (float32: not at all)."""
    from rich.console import Console

    from nxl_hooks.apps.terminal import print_generation
    from nxl_hooks.records.html import generation_html

    model = tiny.overflowing(bpe_tiny.bpe_llama(tok, seed=1))
    note = "outputs at the prediction position are NaN or infinite (an overflow, as in float16)"
    for dtype, said in ((torch.float16, 1), (torch.float32, 0)):
        console = Console(record=True, width=100)
        call = print_generation(model.to(dtype), tok, PROMPT, 2, console=console)
        with torch.no_grad():
            logits = model(**tok(PROMPT, return_tensors="pt")).logits[0, -1]
        assert bool(logits.isnan().any()) == bool(said)
        assert " ".join(console.export_text().split()).count(note) == said
        assert generation_html(call).count(note) == said


def test_evaluate_and_audit_records_read_targets_after_the_text(model, tok):
    from nxl_hooks.eval import audit
    from nxl_hooks.eval import faithfulness as ev

    example = {"text": PROMPT, "target": "Paris", "foil": "London"}
    record = ev.score_example(model, tok, example, methods=["normxlogit", "contrastive"])
    paris, london = piece_id(tok, "ĠParis"), piece_id(tok, "ĠLondon")
    _, probability = oracle_scores(model, tok, PROMPT, [paris, london])
    assert (record["target"], record["foil"]) == (paris, london)
    assert (record["target_text"], record["foil_text"]) == ("␣Paris", "␣London")
    assert record["target_probability"] == pytest.approx(float(probability[0]), rel=1e-4)
    assert record["foil_probability"] == pytest.approx(float(probability[1]), rel=1e-4)
    assert record["readable"] == readable_ids(tok, tok(PROMPT)["input_ids"]) and record["notes"] == []
    split = ev.score_example(model, tok, {"text": PROMPT, "target": "Parisians"}, methods=["normxlogit"])
    assert split["target"] == paris and "only the first, ␣Paris, is explained" in split["notes"][0]
    rec = audit.audit_example(model, model, tok, {"text": PROMPT, "target": "Paris"})
    assert rec["target"] == paris and rec["target_text"] == "␣Paris" and rec["readable"][-1] == "␣is"
    predicted = int(torch.argmax(model(**tok(PROMPT, return_tensors="pt")).logits[0, -1]))
    assert rec["reference_prediction_text"] == readable(tok, predicted) == rec["candidate_prediction_text"]


def test_explain_takes_a_numpy_array_of_targets_as_attach_does(model, tok):
    """attach(target=np.array(...)) is the tensor of ids it stands for; explain refused it ("use ... a tensor of
    ids"), and an array of words is the list of them."""
    import numpy as np

    ids = [piece_id(tok, "ĠParis"), piece_id(tok, "ĠLondon")]
    expected, probability = oracle_scores(model, tok, PROMPT, ids)
    for target in (np.array([ids]), np.array(["Paris", "London"])):
        res = nxl.explain(model, tok, PROMPT, target=target)
        assert res.target.tolist() == [ids]
        torch.testing.assert_close(res.normxlogit[:, 0], expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res.probability[0], probability)


def test_a_numpy_integer_target_saves_and_reads_back(model, tok, tmp_path):
    """A numpy integer among the targets stayed the request in meta["targets"]: the result failed its own check()
    and save() raised TypeError (JSON has no int64). It is the plain int now, and the file reads back the same."""
    import numpy as np

    ids = [piece_id(tok, "ĠParis"), piece_id(tok, "ĠLondon")]
    expected, _ = oracle_scores(model, tok, PROMPT, ids)
    res = nxl.explain(model, tok, PROMPT, target=[np.int64(ids[0]), "London"])
    res.check()
    back = nxl.Attribution.load(res.save(tmp_path / "a.safetensors"))
    assert back.meta["targets"] == res.meta["targets"] and back.meta["targets"][0][0]["request"] == ids[0]
    torch.testing.assert_close(back.normxlogit[:, 0], expected, rtol=1e-4, atol=1e-5)
