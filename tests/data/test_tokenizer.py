import pytest

from quatro_nemo.data.tokenizer import CharTokenizer, TokenizerConfig


def test_ids_roundtrip_and_padding():
    tok = CharTokenizer()
    # 3 special ids + 19 characters = 22, rounded up to a multiple of 16
    assert tok.num_real_tokens == 22 and tok.vocab_size == 32
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.encode("01") == [3, 4]
    text = "3 5 7 2>24:5-2=3,3+7=10"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_prompt("1") == [1, 4] and tok.encode_response("1") == [4, 2]
    assert tok.decode([1, 4, 0, 5, 2, 6]) == "12"  # bos/pad dropped, stops at eos
    assert CharTokenizer(TokenizerConfig(pad_vocab_to_multiple_of=1)).vocab_size == 22


def test_errors():
    with pytest.raises(ValueError, match="'x'"):
        CharTokenizer().encode("1x")
    with pytest.raises(ValueError, match="tokenizer.alphabet"):
        TokenizerConfig(alphabet="aa")
    with pytest.raises(ValueError, match="tokenizer.pad_vocab_to_multiple_of"):
        TokenizerConfig(pad_vocab_to_multiple_of=0)
