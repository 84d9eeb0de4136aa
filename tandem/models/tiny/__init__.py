from tandem.models.tiny.tokenizer import build_tokenizer, save_tokenizer, special_token_ids

__all__ = ["build_tokenizer", "save_tokenizer", "special_token_ids"]
