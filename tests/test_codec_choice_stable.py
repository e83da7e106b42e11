"""The bytes written never change: the same inputs give files of the same sha256.

Varied synthetic tensors (every dtype the formats split, packed 4-bit layouts, 2-D fields
that rows / column classes pay on, tiny and empty tensors, LZ-friendly integer tables) are
written by default, with ``fast=True``, with ``target="gpu"`` (and fast) and in small
segments (which start mid-row and share no histograms); each output's sha256 is pinned
below. The inputs
come from integer arithmetic only (splitmix64, exact float sums), so they are the same on
every machine and numpy version. A change of codec choice, payload or container layout
fails here; where one is intended, regenerate with ``python tests/test_codec_choice_stable.py``
and say why in the commit.
"""

from __future__ import annotations

import hashlib
import io
import sys

import ml_dtypes
import numpy as np
import pytest

from entropykit.api import tensor_source
from entropykit.container.writer import write

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def _bits(seed: int, n: int) -> np.ndarray:
    """splitmix64 of seed * 2**32 + 0..n-1: n uint64 words."""
    with np.errstate(over="ignore"):
        z = (np.arange(n, dtype=np.uint64) + np.uint64(seed << 32)) * np.uint64(
            0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) & _MASK


def _uniform(seed: int, n: int) -> np.ndarray:
    """float64 in [0, 1), exact (53 bits)."""
    return (_bits(seed, n) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _normal(seed: int, n: int) -> np.ndarray:
    """Near-normal float64 (sum of four uniforms, centred): exact arithmetic only."""
    u = _uniform(seed, 4 * n).reshape(4, n)
    return (u[0] + u[1] + u[2] + u[3]) - 2.0


def _ints(seed: int, n: int, hi: int) -> np.ndarray:
    return (_bits(seed, n) % np.uint64(hi)).astype(np.int64)


def _weights(seed: int, rows: int, cols: int, scale: float = 0.02) -> np.ndarray:
    """float64 [rows, cols] whose rows have power-of-two scales 64x apart: classes pay."""
    row_scale = 2.0 ** -_ints(seed + 1, rows, 7).astype(np.float64)
    return _normal(seed, rows * cols).reshape(rows, cols) * row_scale[:, None] * scale


def _cases() -> dict[str, dict[str, np.ndarray]]:
    bf16, e4m3, e5m2 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    emb = _normal(20, 512 * 96).reshape(512, 96) * 0.05
    emb[100:400] = 0.01  # untrained rows, one value: LZ matching pays on the low bytes
    scales = (_ints(30, 2048, 9) + 120).astype(np.uint8)
    return {
        "bf16_2d": {"w": _weights(1, 384, 256).astype(bf16)},
        "bf16_3d": {"w": _weights(2, 4 * 48, 96).reshape(4, 48, 96).astype(bf16)},
        "bf16_1d": {"b": (_normal(3, 70_000) * 0.1).astype(bf16)},
        "bf16_coarse": {"b": (np.round(_normal(40, 70_000) * 16) / 16
                              * 2.0 ** -_ints(41, 70_000, 6)).astype(bf16)},
        "f16_2d": {"w": _weights(4, 256, 320).astype(np.float16)},
        "f32_2d": {"w": _weights(5, 128, 256).astype(np.float32)},
        "f32_emb": {"emb": emb.astype(np.float32)},
        "f64_2d": {"w": _weights(6, 64, 96).astype(np.float64)},
        "e4m3_2d": {"w": (_weights(7, 256, 384, 40.0)).astype(e4m3)},
        "e4m3_wide": {"w": (_normal(42, 90_000) * _normal(43, 90_000) * 300).astype(e4m3)},
        "e5m2_1d": {"w": (_normal(8, 90_000) * 3.0).astype(e5m2)},
        "e8m0": {"s": scales.view(ml_dtypes.float8_e8m0fnu)},
        "u8": {"x": (_ints(9, 50_000, 5) * 3).astype(np.uint8)},
        "i8_2d": {"q": np.clip(_weights(10, 128, 256, 60.0), -127, 127).astype(np.int8)},
        "i16_ramp": {"x": (np.arange(40_000) % 1000).astype(np.int16)},
        "i32_tokens": {"ids": _ints(11, 30_000, 30_000).astype(np.int32)},
        "i64_positions": {"position_ids": np.arange(4096, dtype=np.int64)[None, :]},
        "bool_mask": {"m": (_ints(12, 20_000, 16) < 3) | (np.arange(20_000) % 500 < 100)},
        "constant": {"z": np.zeros((64, 128), np.float32)},
        "mxfp4": {"e.w_blocks": _ints(13, 96 * 16, 256).astype(np.uint8).reshape(96, 16),
                  "e.w_scales": scales[:96]},
        "nvfp4": {"l.weight_packed": _ints(14, 64 * 32, 200).astype(np.uint8).reshape(64, 32),
                  "l.weight_scale": (_normal(15, 64 * 2) * 8).astype(e4m3).reshape(64, 2)},
        "int4": {"m.qweight": _bits(16, 32 * 64).astype(np.uint32).view(np.int32)[::2]
                 .reshape(32, 32),
                 "m.qzeros": _bits(17, 8).astype(np.uint32).view(np.int32)[::2],
                 "m.scales": (_normal(18, 32) * 0.01).astype(np.float16)},
        "tiny": {"a": np.array([1.5], np.float32), "b": np.array([1, -2, 3], bf16),
                 "c": np.ones((2, 2), np.float16), "d": np.array([7, 7, 0, 1, 7], e4m3),
                 "e": np.array([True]), "f": np.arange(3, dtype=np.int64)},
        "empty": {"a": np.zeros(0, np.uint8), "b": np.zeros((0, 8), bf16),
                  "c": np.zeros((3, 0), np.float32)},
    }


_VARIANTS = {
    "cpu": {},
    "fast": {"fast": True},
    "gpu": {"target": "gpu"},
    "gpu_fast": {"target": "gpu", "fast": True},
    "segments": {"segment_bytes": 1 << 14},
}


def _digest(tensors: dict[str, np.ndarray], options: dict) -> str:
    out = io.BytesIO()
    write(tensor_source(tensors, None), out, threads=1, **options)
    return hashlib.sha256(out.getvalue()).hexdigest()


HASHES: dict[str, str] = {
    "cpu/bf16_2d": "d12eaac489c5cea8a466a294dcda94ef5a6d14081d8e76d58ea2a344e1ae47d8",
    "cpu/bf16_3d": "9b38c88dec16dcb715bf3b8091f659170df4a5b9a40004de6eb53b3f457f3df3",
    "cpu/bf16_1d": "06416b17dae0ea84fc22ea865d145c699867e208913f7c366494e83bb8fa2cc4",
    "cpu/bf16_coarse": "c587da4ce71f162f19542399a7269c1a2ff0cf4f7a9b916e8442eb25ccbc6d62",
    "cpu/f16_2d": "853da36d986733831ff488ffc577f47df82d40e95a97b23d9105912edbc2c9e1",
    "cpu/f32_2d": "3187a7cae2378008aeffc7015eb840657122257c0cfe40bf859c1355c460b83b",
    "cpu/f32_emb": "b4e43ae2b4c06f581a207fc621fbc458cfb56652f0b1646ff220053d6ce03c54",
    "cpu/f64_2d": "696d5e45abdc52fad4617764308daec7c48cab904841692e6401d249029e4c0e",
    "cpu/e4m3_2d": "a88f205bb71f828d12976eeff7e8522f2ba6482099d291a08401f16922ca931e",
    "cpu/e4m3_wide": "a878f76245f37146ff35a0c29797678a606d602fd83340cc174adf9e534a5e79",
    "cpu/e5m2_1d": "153d4ae1a341457f95715c1ebe2ee627bef3222d732bc744eadb9cf8749d3632",
    "cpu/e8m0": "c4187ffcce795b9593c1e4d09bd57461bcd8a2bc9849f1c35878d9e36d54ee0e",
    "cpu/u8": "803e31184d4dcd01814aa08f1c9a037f8acc4afb3f119214ad4c3c48ded1719f",
    "cpu/i8_2d": "6e927938fd4da56900f2b334f87af79571d50fc47cce88880b770db21dd9cffb",
    "cpu/i16_ramp": "37f5010f1d8d2a42e30c5f67cbffdb946e03cc2f65e7e3c6712d50e2a43628be",
    "cpu/i32_tokens": "23fa3fa68a8a09bd2391c5b783523f002c485279e2584714b79c40de3071c7ee",
    "cpu/i64_positions": "853c83c40c9fc3f2534ccbc7bba0f4e6a87f2adfe396235f87504975ca40b301",
    "cpu/bool_mask": "c2548c5af852a20b7d8135575eb75976d192a260aeb30ef1c687f2abecd3aa76",
    "cpu/constant": "85c7b7493b654d1e01e148e40b86c3d3f105e279016ae4a2a5b6609a6c6289e5",
    "cpu/mxfp4": "395f8b67c81365c43541158e7d1c13f00fda4cd53a144ea1313f9fa0f5958e33",
    "cpu/nvfp4": "15b1bd9701111f42df6be31829e8afc1cd4d5a41ca9331704961d70fbaa9393c",
    "cpu/int4": "9011978f16eec31e5411dc65f6a13bdfd9f6933d89e6eab03a58bcf697022c0d",
    "cpu/tiny": "63d34d0214f461d872ef924d48e60ec4f39cea41e3385d829fb3767bfe0c7a1b",
    "cpu/empty": "f067d5cfd98333952f0712a54487d298d0c29534364e4b28bebe70553168d99b",
    "fast/bf16_2d": "07d8c23c0d677866ff3b0d1ae69a6e86ed874bc488c93811710c663e1e553aa6",
    "fast/bf16_3d": "a6ed03a279b2d6ffebec8ba9ec3456fd99c4b4a7c70282ca3609b3aaa0a2411d",
    "fast/bf16_1d": "26747d3405ee5f0748cb94cafcab8c86183b11549363c6c80d8c620391cdee77",
    "fast/bf16_coarse": "c587da4ce71f162f19542399a7269c1a2ff0cf4f7a9b916e8442eb25ccbc6d62",
    "fast/f16_2d": "0656aa4694786afac794c7572cfe25fdb53eccc107a68e627d7d00953abcf629",
    "fast/f32_2d": "fb6bbe63fbcbc70ee6b14403f5c05ac0751e7cc8663d57419ca461f3216bb7bf",
    "fast/f32_emb": "a91c9421f795f4ccfea293f54c3b2f573e1796c2d85ebf78e27a52c032d80955",
    "fast/f64_2d": "ff632aca64a7dd51a7054b7cf73f6bed1655b03d817a94696869a3de848d9ba2",
    "fast/e4m3_2d": "adc8ab9818aeb08d480a0f3c356f0bb2a85841bd88f225962edc27d53cced67a",
    "fast/e4m3_wide": "eb76e85082da1aaf93f7ded1fa3c54c9e914a086282aa0b88f9d2d5bf896553e",
    "fast/e5m2_1d": "153d4ae1a341457f95715c1ebe2ee627bef3222d732bc744eadb9cf8749d3632",
    "fast/e8m0": "94155364e23484f976a1947706a04370ff535ff129d02c3986ab52280b285e16",
    "fast/u8": "070956aad6589070b5f74f0aca23b75dee30e082f40ed361c8a4cb41b9b9394e",
    "fast/i8_2d": "73f6315f21ab653297b126a4eeda7ed43d41fa02793cf38fe983a575706ad22f",
    "fast/i16_ramp": "8c7d61d6c0d6df9d75237846a50195ca8b255e139d785dd1fed7a94be6476402",
    "fast/i32_tokens": "23fa3fa68a8a09bd2391c5b783523f002c485279e2584714b79c40de3071c7ee",
    "fast/i64_positions": "f8ff78eab1c5df8011115082a51aecd8a9029c20cf65d6709451f6d0e7462435",
    "fast/bool_mask": "3fe43a16bcce1e1e96e597c49efa4c05478281195ba95a57d486db0b618a9f86",
    "fast/constant": "85c7b7493b654d1e01e148e40b86c3d3f105e279016ae4a2a5b6609a6c6289e5",
    "fast/mxfp4": "e53aba1a586efe5916910c12d9465c6f7eeac562b64cb038b0aa469da5d56071",
    "fast/nvfp4": "21d28946aac660db0b27be63113a43deec180988cdec3a874137927bebb8df88",
    "fast/int4": "9011978f16eec31e5411dc65f6a13bdfd9f6933d89e6eab03a58bcf697022c0d",
    "fast/tiny": "63d34d0214f461d872ef924d48e60ec4f39cea41e3385d829fb3767bfe0c7a1b",
    "fast/empty": "f067d5cfd98333952f0712a54487d298d0c29534364e4b28bebe70553168d99b",
    "gpu/bf16_2d": "4c03beccfb90e374fa3f5b15cf51dfcbe866987f71173d9e1dd3c4e1e6dce814",
    "gpu/bf16_3d": "91fe0ae04ffea59053d763c5f203fd7cadc71d66c2d42d1859c30139f4b1b5a5",
    "gpu/bf16_1d": "10a83052549f7b8748f6456cb63b6f1c6d2d040d22ceea47fa35d2f78336092c",
    "gpu/bf16_coarse": "43732424d47f2ae8329586edea915a9709841a37b5654c91754f37ce9a03d5e2",
    "gpu/f16_2d": "5e7d991d105d80c36e1ca3c5b7304cfc82f19406b0190f65af6240cf609b2a88",
    "gpu/f32_2d": "351077d6aa648f862239bb3ebbdefc1a529690ea113520bfa49a6131d5ddbe76",
    "gpu/f32_emb": "a91c9421f795f4ccfea293f54c3b2f573e1796c2d85ebf78e27a52c032d80955",
    "gpu/f64_2d": "dcde296ac816476a06a20847280b3abf92724578a446ce9aacfc2d80f1a9a8d6",
    "gpu/e4m3_2d": "9bcdcdf7fdf11acd6114ed1c92742f29effde149e2736c5184d3e7e70d95e5fa",
    "gpu/e4m3_wide": "08ad470a02899735b2e7a0c3d760c377663f7fc13ab1d9bf26cc84918089e8d9",
    "gpu/e5m2_1d": "3e33893e8e9eaa9d2a2693db3c408f34562c8688f3948bbf9ace58537b1250c4",
    "gpu/e8m0": "8d40f133b9fa2f6647c1f014b68bd44ff2fc7de869330658694926c152187261",
    "gpu/u8": "d26231800aca84582b33a4be2277d08e0caaa67c5d171760937661cf95536201",
    "gpu/i8_2d": "73f6315f21ab653297b126a4eeda7ed43d41fa02793cf38fe983a575706ad22f",
    "gpu/i16_ramp": "37f5010f1d8d2a42e30c5f67cbffdb946e03cc2f65e7e3c6712d50e2a43628be",
    "gpu/i32_tokens": "23fa3fa68a8a09bd2391c5b783523f002c485279e2584714b79c40de3071c7ee",
    "gpu/i64_positions": "853c83c40c9fc3f2534ccbc7bba0f4e6a87f2adfe396235f87504975ca40b301",
    "gpu/bool_mask": "140b6c7400b92333b095295f15fdd828cf3abb792fb65130d93e463e8d0d3ade",
    "gpu/constant": "85c7b7493b654d1e01e148e40b86c3d3f105e279016ae4a2a5b6609a6c6289e5",
    "gpu/mxfp4": "395f8b67c81365c43541158e7d1c13f00fda4cd53a144ea1313f9fa0f5958e33",
    "gpu/nvfp4": "15b1bd9701111f42df6be31829e8afc1cd4d5a41ca9331704961d70fbaa9393c",
    "gpu/int4": "9011978f16eec31e5411dc65f6a13bdfd9f6933d89e6eab03a58bcf697022c0d",
    "gpu/tiny": "63d34d0214f461d872ef924d48e60ec4f39cea41e3385d829fb3767bfe0c7a1b",
    "gpu/empty": "f067d5cfd98333952f0712a54487d298d0c29534364e4b28bebe70553168d99b",
    "gpu_fast/bf16_2d": "4c03beccfb90e374fa3f5b15cf51dfcbe866987f71173d9e1dd3c4e1e6dce814",
    "gpu_fast/bf16_3d": "91fe0ae04ffea59053d763c5f203fd7cadc71d66c2d42d1859c30139f4b1b5a5",
    "gpu_fast/bf16_1d": "10a83052549f7b8748f6456cb63b6f1c6d2d040d22ceea47fa35d2f78336092c",
    "gpu_fast/bf16_coarse": "43732424d47f2ae8329586edea915a9709841a37b5654c91754f37ce9a03d5e2",
    "gpu_fast/f16_2d": "5e7d991d105d80c36e1ca3c5b7304cfc82f19406b0190f65af6240cf609b2a88",
    "gpu_fast/f32_2d": "351077d6aa648f862239bb3ebbdefc1a529690ea113520bfa49a6131d5ddbe76",
    "gpu_fast/f32_emb": "a91c9421f795f4ccfea293f54c3b2f573e1796c2d85ebf78e27a52c032d80955",
    "gpu_fast/f64_2d": "7081804c490655f2997f981b3c78aa6804069abe5d530ae28640102dbd24fd72",
    "gpu_fast/e4m3_2d": "9bcdcdf7fdf11acd6114ed1c92742f29effde149e2736c5184d3e7e70d95e5fa",
    "gpu_fast/e4m3_wide": "08ad470a02899735b2e7a0c3d760c377663f7fc13ab1d9bf26cc84918089e8d9",
    "gpu_fast/e5m2_1d": "3e33893e8e9eaa9d2a2693db3c408f34562c8688f3948bbf9ace58537b1250c4",
    "gpu_fast/e8m0": "8d40f133b9fa2f6647c1f014b68bd44ff2fc7de869330658694926c152187261",
    "gpu_fast/u8": "d26231800aca84582b33a4be2277d08e0caaa67c5d171760937661cf95536201",
    "gpu_fast/i8_2d": "73f6315f21ab653297b126a4eeda7ed43d41fa02793cf38fe983a575706ad22f",
    "gpu_fast/i16_ramp": "8c7d61d6c0d6df9d75237846a50195ca8b255e139d785dd1fed7a94be6476402",
    "gpu_fast/i32_tokens": "23fa3fa68a8a09bd2391c5b783523f002c485279e2584714b79c40de3071c7ee",
    "gpu_fast/i64_positions": "f8ff78eab1c5df8011115082a51aecd8a9029c20cf65d6709451f6d0e7462435",
    "gpu_fast/bool_mask": "140b6c7400b92333b095295f15fdd828cf3abb792fb65130d93e463e8d0d3ade",
    "gpu_fast/constant": "85c7b7493b654d1e01e148e40b86c3d3f105e279016ae4a2a5b6609a6c6289e5",
    "gpu_fast/mxfp4": "e53aba1a586efe5916910c12d9465c6f7eeac562b64cb038b0aa469da5d56071",
    "gpu_fast/nvfp4": "21d28946aac660db0b27be63113a43deec180988cdec3a874137927bebb8df88",
    "gpu_fast/int4": "9011978f16eec31e5411dc65f6a13bdfd9f6933d89e6eab03a58bcf697022c0d",
    "gpu_fast/tiny": "63d34d0214f461d872ef924d48e60ec4f39cea41e3385d829fb3767bfe0c7a1b",
    "gpu_fast/empty": "f067d5cfd98333952f0712a54487d298d0c29534364e4b28bebe70553168d99b",
    "segments/bf16_2d": "905c6142759dff607f79793a229a08fb84ad5c7fe840f6d3b344a3023488f27a",
    "segments/bf16_3d": "578ca9e5bdbc238cf5817e5c83005911068bea1cff5cfccdc4b5432931b3cee1",
    "segments/bf16_1d": "68ec4886c0f18d27f3e67bc954bfdcc6bdb68c22e76eabadf01620600520a009",
    "segments/bf16_coarse": "1f5084498c989208fa3d689799186b581b4bdd676e8b01afc79b9bff2fa4aa8a",
    "segments/f16_2d": "f2c1224faa675e97936b6a1d3ff9c6070f729aee98198cc9abd8e32238346681",
    "segments/f32_2d": "fa44c616e7e610e3540850d2b8cdeb791838c3a2475c6dfac7fb80428cb17de2",
    "segments/f32_emb": "3adf04e00a2286647584ad864ba15168e8ed7923959fa298b15151004af578de",
    "segments/f64_2d": "545e1cbfdd0bb4e14894a2a166f956b1052d3a4b5a81e45af6f4b8485c635131",
    "segments/e4m3_2d": "13ad6661bef4ef64e40a81510f0806522f5d31447e7bb7990cc31f7782945b9d",
    "segments/e4m3_wide": "7d429bd5e03affae5cbf8ecad7d00b855ac2e779d6548cf0941bbb36c56dfdec",
    "segments/e5m2_1d": "6c76a67b344567fb739b03311561b6d7b5275d105384f7641b2349b255ea7045",
    "segments/e8m0": "636658b157a45b796aea2563b2870104590443aff8fd4966532239b3765a556f",
    "segments/u8": "13639dced53c4ee53bc854efe2bb3db8c8c2fb087ec189633019bd8b0c5646e8",
    "segments/i8_2d": "ef527fe49a7085641cfe9cfeddb2d145dc8c6d7137395bafa511266b5a4606bb",
    "segments/i16_ramp": "c24fdbf4d30c3312275ab8153f23af97b59d7988f7056a63d3e3fea7d5b4e4d1",
    "segments/i32_tokens": "619f3cd57963d936ba414835798742dfb6c0edb0e044890769880615c824435d",
    "segments/i64_positions": "8f2f0d1a7913321fb6bd35a59a486437547f43e06d0f685ef2d000cdeeb3b739",
    "segments/bool_mask": "f12f3098e9b28d574a6bbea161bff0cca953e13a7fd6e40b472847267e3e6b18",
    "segments/constant": "894438acd5a07614de683b53536016c8ad99a146593732bb51d5dca209695edc",
    "segments/mxfp4": "412d2a3407c5c7faf9d5574607069f730893e36b298358aa84bc07a7c583196b",
    "segments/nvfp4": "f0a122793bbc7fe21f4ffe024ca0931db9ea46ed9f6fc1681123cd15d53b31f9",
    "segments/int4": "ef4b1843c0cb433d34be1e64cacea1670f3230737ca498694ba73fa3aa4e2061",
    "segments/tiny": "a3ad52ec5b01e578b10c3633d443b262d72125380cd794fdfbf9b6b6e5ae35d6",
    "segments/empty": "1b6abd3b610b396f9ee1f7324771e9ec42feab32cd71164bee56b58e3dc72b22",
}


@pytest.mark.parametrize("variant", sorted(_VARIANTS))
def test_outputs_are_unchanged(variant: str) -> None:
    got = {name: _digest(t, _VARIANTS[variant]) for name, t in _cases().items()}
    want = {name: HASHES[f"{variant}/{name}"] for name in got}
    assert got == want


def _mixed() -> dict[str, np.ndarray]:
    """bf16, fp8 and fp32 tensors of several 16 KiB segments each (segments start mid-row)."""
    return {"w": _weights(50, 160, 200).astype(ml_dtypes.bfloat16),
            "f8": _weights(51, 96, 384, 40.0).astype(ml_dtypes.float8_e4m3fn),
            "s": _weights(52, 64, 100).astype(np.float32)}


# One file of many segments per tensor, written on 1 and on 3 threads: the bytes depend
# on neither the thread count nor how the policy's per-segment work is arranged.
MIXED_HASHES = {
    "cpu": "9a793aa50497e83e83e84270e09e57a2d692f043e5b85f00d10d2f856ae9ac9a",
    "fast": "2d00da7a8620bb77dc6b879d4ff781b3e645e251c422f6dd560216f88babe3bc",
}


@pytest.mark.parametrize("variant", sorted(MIXED_HASHES))
@pytest.mark.parametrize("threads", [1, 3])
def test_multi_segment_mixed_file_is_unchanged(variant: str, threads: int) -> None:
    out = io.BytesIO()
    write(tensor_source(_mixed(), None), out, threads=threads, segment_bytes=1 << 14,
          **_VARIANTS[variant])
    assert hashlib.sha256(out.getvalue()).hexdigest() == MIXED_HASHES[variant]


if __name__ == "__main__":
    cases = _cases()
    sys.stdout.write("HASHES: dict[str, str] = {\n")
    for variant, options in sorted(_VARIANTS.items()):
        for name, tensors in cases.items():
            sys.stdout.write(f'    "{variant}/{name}": "{_digest(tensors, options)}",\n')
    sys.stdout.write("}\n")
