# The two commands a newcomer needs: `make demo` and `make test`. Both use the virtual environment .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= The list object

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/genai export reference --out out/reference
	$(BIN)/genai inspect out/reference/text_decoder.pte
	$(BIN)/genai run out/reference --prompt "$(PROMPT)" --max-new-tokens 80 --temperature 0.7 --top-p 0.9

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python bench/slice.py

clean:
	rm -rf out bench/results
