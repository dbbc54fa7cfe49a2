"""From a request to tokens: the prompt and its fenced input, the tokenizer's quirks, the compiled rows, tries and grammars."""
