# qwen35-serve on a vLLM OpenAI image: our vLLM plugin, kernels and serving kit on top of the
# image's own torch / triton / vLLM (installed with --no-deps, so a vendor build is never replaced).
#
#   docker build -t qwen35-serve .
#   docker build --build-arg BASE_IMAGE=<vendor vLLM image, e.g. an Iluvatar CoreX one> -t qwen35-serve:ix .
#
#   # the embedded tiny model (no config, no weights): try the API
#   docker run --rm -p 8000:8000 qwen35-serve
#   # a real model: mount the weights and a YAML config (keys mirror vLLM's options)
#   docker run --rm --gpus all --ipc=host -p 8000:8000 -e VLLM_API_KEY=... \
#       -v /models:/models:ro -v $PWD/serve/configs/qwen35-27b-tp4.yaml:/etc/qwen35/config.yaml:ro \
#       qwen35-serve
#   # overrides after the image name win over the file: ... qwen35-serve /etc/qwen35/config.yaml --port 9000
#
# The base image's vLLM must be in qwen35's supported range, >=0.26,<0.33 (qwen35/vllm_adapter.py checks it at import).
ARG BASE_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${BASE_IMAGE}

WORKDIR /opt/qwen35
COPY pyproject.toml README.md ./
COPY qwen35 ./qwen35
COPY kernels_triton ./kernels_triton
COPY kernels_cuda ./kernels_cuda
COPY serve ./serve
COPY tuning ./tuning

# pyyaml, safetensors, transformers, fastapi and httpx come with vLLM itself.
RUN python3 -m pip install --no-cache-dir --no-deps . \
    && python3 -c "import qwen35, serve.launcher, yaml" \
    && command -v qwen35-serve

# Build the embedded checkpoint into the image, so a container without a model starts without
# writing anything; the config file defaults to an empty one (the embedded model).
ENV QWEN35_CACHE_DIR=/opt/qwen35/cache
RUN python3 -c "from serve.embedded.checkpoint import ensure_checkpoint; print(ensure_checkpoint())" \
    && mkdir -p /etc/qwen35 && printf '# mount a config here (see serve/configs/)\nhost: 0.0.0.0\nport: 8000\n' \
    > /etc/qwen35/config.yaml

EXPOSE 8000
ENTRYPOINT ["qwen35-serve"]
CMD ["/etc/qwen35/config.yaml"]
