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

from entropykit.api import _source
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
    write(_source(tensors, None), out, threads=1, **options)
    return hashlib.sha256(out.getvalue()).hexdigest()


HASHES: dict[str, str] = {
    "cpu/bf16_2d": "1911372dcc9494dd82d02df80daddf565eabc1422fa0b51d6431ad88900a0f41",
    "cpu/bf16_3d": "a060ff15734cb2853288a6921ad82dac73adfc2fe731904ce86b5397ff84d6da",
    "cpu/bf16_1d": "b3cb3954f49b3e9d9d9cca1ed11c22225e516396bb8cc365643a5e2e8b215f72",
    "cpu/bf16_coarse": "b02484ffe7f09a640d3eb0ee08d225283ff406bb2561da84156748a016cf5513",
    "cpu/f16_2d": "c416fd090585d56846eb0587bbda7e60d44af574b0f0d79d276ee724ed6c6fef",
    "cpu/f32_2d": "0bea3ef261217a82840c6bcde21bb346704a6001288e44a7b48c33db0ad2e0ae",
    "cpu/f32_emb": "52df7352cf398a5c3fd2197b06784d0ce7f710d6efc0edc1d6e910846c4cdeee",
    "cpu/f64_2d": "f8499eb956f3dd4c0963df3c50345aa3536b02b4d9443991bbcd7fce90761721",
    "cpu/e4m3_2d": "87927f59462039778adadd5cae749d4fc484c6d4e7eaa21a8f7203d4f39cfc10",
    "cpu/e4m3_wide": "1089eb1346cb998b7ba4cb5b84b71e3b4f1ac72796311371c57283ba5e224523",
    "cpu/e5m2_1d": "14a75445a31a51265ccf7ef01b29aa11be559f954343eec561bf7f70c7f4d0d5",
    "cpu/e8m0": "03c2986f472b59492bc385f88265d071d9704281bb16728462a7abd6e01ba57e",
    "cpu/u8": "a6598981ce47137bcbb973d76363dfdcd7f7c86df003cd781b19049a66bb6a38",
    "cpu/i8_2d": "7f080db0b027b77097a17f05aad7ac360f4f7a56bef6382911387b2db478f8a7",
    "cpu/i16_ramp": "eb16505c32e870be971e8f43e1caed0299156479b2ca36923ce301ae664bd82f",
    "cpu/i32_tokens": "ada3cc19035f77ca5da6bfde1f24697aad000afbe9ae8b2e8877762cad30878b",
    "cpu/i64_positions": "d6ab98de56f5c530821b84ea772da78860b51b060923c99a4b9004d74cec9646",
    "cpu/bool_mask": "f64c287a6312d66d4bdd8121e16ebf60ced5a5995b560c240035ef663c42194a",
    "cpu/constant": "5173d102830f7784e0eb9a73dabeaf0f1d115cb21916caa0c6c0442a0b5c3188",
    "cpu/mxfp4": "63b319937e5c4c633d21c989fdde2dbb2e0be587f609a7329e5463cfcccddcd8",
    "cpu/nvfp4": "cff5ad56b7c1f270c66256db68188ab880397075fbc461c4742c0b3a2c8852c9",
    "cpu/int4": "b51d3123a5aca506cde4df2c748d549127d4f25ef5cc01625fb3a1f64215514f",
    "cpu/tiny": "bfb96daef622b8e6e31637cc5477653e4edf5684cb7270c0d03ae3a2be0b79f3",
    "cpu/empty": "99464b8f788cdfad6b71f0bebd90fd1bc57705a5e5d98a6f5c86eb119137ca9d",
    "fast/bf16_2d": "3cde50cd12aaf142ccba0ab5cad76fa63dbf3accd869539fd4a81357307beaca",
    "fast/bf16_3d": "c99907f62633f062b5729c3eac07187b7268e4e1781f6976bdbe42d79bb35a68",
    "fast/bf16_1d": "b3cb3954f49b3e9d9d9cca1ed11c22225e516396bb8cc365643a5e2e8b215f72",
    "fast/bf16_coarse": "19d7c90c5f5316762ecff4525d31259f4674f58b2f40cab7e21d2840ea6faec4",
    "fast/f16_2d": "8df0e93868b9059eb6c2ff9e26712cb0232fd390117a8d97da7a08554dd6461f",
    "fast/f32_2d": "d785df9e3153a19719c80c6781185e777a2c2f310a339f9c3ebb217dfabd2fad",
    "fast/f32_emb": "ea155b90fccc44806edc5273f7bdaac9b887c66ad2e7b9aee51ea26fac676252",
    "fast/f64_2d": "9a11efa2be545bbbae5e6006f031ea358ec7e5e2d3cb7e7cb7d36aba94720de4",
    "fast/e4m3_2d": "96cb30a2e2c63acb2a88b4fad051a7b5534011b513ff8378237570b6a0a781c4",
    "fast/e4m3_wide": "2de564af911504bf04c5aecee81b1f2c2cc4c486ddd83146a6eb0326b06d0ea5",
    "fast/e5m2_1d": "a5ff08db4af1cc4536b568d3246fca4db839a6585241b7129f2d4deb256c16e0",
    "fast/e8m0": "03c2986f472b59492bc385f88265d071d9704281bb16728462a7abd6e01ba57e",
    "fast/u8": "a6598981ce47137bcbb973d76363dfdcd7f7c86df003cd781b19049a66bb6a38",
    "fast/i8_2d": "17526f6697d117544419d0a3d6cc3088edfb008bda23823a1fe51a4a832465e4",
    "fast/i16_ramp": "a88e335672cfbeb1f0a4d310571e50c40e83edd6dea8998fdb5882e40973b548",
    "fast/i32_tokens": "ada3cc19035f77ca5da6bfde1f24697aad000afbe9ae8b2e8877762cad30878b",
    "fast/i64_positions": "7ac0a8e25564cd57dc02de65fe0403b21878c1b7b8bbf2c5b1996fa8e2a33f0d",
    "fast/bool_mask": "f64c287a6312d66d4bdd8121e16ebf60ced5a5995b560c240035ef663c42194a",
    "fast/constant": "5173d102830f7784e0eb9a73dabeaf0f1d115cb21916caa0c6c0442a0b5c3188",
    "fast/mxfp4": "8a5c3a03ad378e47ac8111a45b2c7ce3a53dd5878cfbe6c19c37f8d67e542ec7",
    "fast/nvfp4": "f8550bba253f30b982912a758aa92afd6238bd8a9679333d49ffab883e90290a",
    "fast/int4": "b51d3123a5aca506cde4df2c748d549127d4f25ef5cc01625fb3a1f64215514f",
    "fast/tiny": "bfb96daef622b8e6e31637cc5477653e4edf5684cb7270c0d03ae3a2be0b79f3",
    "fast/empty": "99464b8f788cdfad6b71f0bebd90fd1bc57705a5e5d98a6f5c86eb119137ca9d",
    "gpu/bf16_2d": "0bd0c5b3f8d2be8c176a5f71664bf0baf854935b2cee06d405553c733c550c39",
    "gpu/bf16_3d": "4c8c1174f7ca532cec0cc9ff75fa5ecf6668bb3314bb5dd1208e139cbcb4f5a8",
    "gpu/bf16_1d": "b922845c117cc657ece93832ec5e47ecbf01bb4c4517e775c8684414caac336f",
    "gpu/bf16_coarse": "f897393accc49c30345b1f05c3bc6752fc633155a7a360eb3e3364901548d7c3",
    "gpu/f16_2d": "95e3e32953a335fca24ccc6c72e21638e247f3d08a63cc7665fe3925e52e1173",
    "gpu/f32_2d": "02d0359704c243885ac978b044b6e8b6c879f2dd8ea1e342252578b8af13d0b8",
    "gpu/f32_emb": "ea155b90fccc44806edc5273f7bdaac9b887c66ad2e7b9aee51ea26fac676252",
    "gpu/f64_2d": "accb3acd2329bc9685099be1e978225a2fd11d47e66f4ef6360f522a2aa103d6",
    "gpu/e4m3_2d": "41bb2e207198f67184583472ef864e2bd6ae2cb6c122ddc4f4443a5a6c2dc1f0",
    "gpu/e4m3_wide": "437e49c4bc41b9c7c4751e715871b3685f4e0e96c6156eaad330770161f3be52",
    "gpu/e5m2_1d": "a2e7b156209b4aa233b95d3eb4bf58579f299e0f76780a52aa91b61a47e16fd3",
    "gpu/e8m0": "9e313c910f2c2a5cb0ba43cb6045934bfca234679aff98bb1b4060048081d045",
    "gpu/u8": "88950edffe1b5fd7005202019d499c2c85fe073941f01fce8b360f64699f91f3",
    "gpu/i8_2d": "17526f6697d117544419d0a3d6cc3088edfb008bda23823a1fe51a4a832465e4",
    "gpu/i16_ramp": "eb16505c32e870be971e8f43e1caed0299156479b2ca36923ce301ae664bd82f",
    "gpu/i32_tokens": "ada3cc19035f77ca5da6bfde1f24697aad000afbe9ae8b2e8877762cad30878b",
    "gpu/i64_positions": "d6ab98de56f5c530821b84ea772da78860b51b060923c99a4b9004d74cec9646",
    "gpu/bool_mask": "7bab59095752991cc0d794fc94463f69dfadcf62da338d6a6ad6a681b61fd53f",
    "gpu/constant": "5173d102830f7784e0eb9a73dabeaf0f1d115cb21916caa0c6c0442a0b5c3188",
    "gpu/mxfp4": "63b319937e5c4c633d21c989fdde2dbb2e0be587f609a7329e5463cfcccddcd8",
    "gpu/nvfp4": "cff5ad56b7c1f270c66256db68188ab880397075fbc461c4742c0b3a2c8852c9",
    "gpu/int4": "b51d3123a5aca506cde4df2c748d549127d4f25ef5cc01625fb3a1f64215514f",
    "gpu/tiny": "bfb96daef622b8e6e31637cc5477653e4edf5684cb7270c0d03ae3a2be0b79f3",
    "gpu/empty": "99464b8f788cdfad6b71f0bebd90fd1bc57705a5e5d98a6f5c86eb119137ca9d",
    "gpu_fast/bf16_2d": "0bd0c5b3f8d2be8c176a5f71664bf0baf854935b2cee06d405553c733c550c39",
    "gpu_fast/bf16_3d": "4c8c1174f7ca532cec0cc9ff75fa5ecf6668bb3314bb5dd1208e139cbcb4f5a8",
    "gpu_fast/bf16_1d": "b922845c117cc657ece93832ec5e47ecbf01bb4c4517e775c8684414caac336f",
    "gpu_fast/bf16_coarse": "f897393accc49c30345b1f05c3bc6752fc633155a7a360eb3e3364901548d7c3",
    "gpu_fast/f16_2d": "95e3e32953a335fca24ccc6c72e21638e247f3d08a63cc7665fe3925e52e1173",
    "gpu_fast/f32_2d": "02d0359704c243885ac978b044b6e8b6c879f2dd8ea1e342252578b8af13d0b8",
    "gpu_fast/f32_emb": "ea155b90fccc44806edc5273f7bdaac9b887c66ad2e7b9aee51ea26fac676252",
    "gpu_fast/f64_2d": "4119ef22d4f2b52da8958a1be204fe0118d5ebf1f169d8b207e546dc8240d001",
    "gpu_fast/e4m3_2d": "41bb2e207198f67184583472ef864e2bd6ae2cb6c122ddc4f4443a5a6c2dc1f0",
    "gpu_fast/e4m3_wide": "437e49c4bc41b9c7c4751e715871b3685f4e0e96c6156eaad330770161f3be52",
    "gpu_fast/e5m2_1d": "a2e7b156209b4aa233b95d3eb4bf58579f299e0f76780a52aa91b61a47e16fd3",
    "gpu_fast/e8m0": "9e313c910f2c2a5cb0ba43cb6045934bfca234679aff98bb1b4060048081d045",
    "gpu_fast/u8": "88950edffe1b5fd7005202019d499c2c85fe073941f01fce8b360f64699f91f3",
    "gpu_fast/i8_2d": "17526f6697d117544419d0a3d6cc3088edfb008bda23823a1fe51a4a832465e4",
    "gpu_fast/i16_ramp": "a88e335672cfbeb1f0a4d310571e50c40e83edd6dea8998fdb5882e40973b548",
    "gpu_fast/i32_tokens": "ada3cc19035f77ca5da6bfde1f24697aad000afbe9ae8b2e8877762cad30878b",
    "gpu_fast/i64_positions": "7ac0a8e25564cd57dc02de65fe0403b21878c1b7b8bbf2c5b1996fa8e2a33f0d",
    "gpu_fast/bool_mask": "7bab59095752991cc0d794fc94463f69dfadcf62da338d6a6ad6a681b61fd53f",
    "gpu_fast/constant": "5173d102830f7784e0eb9a73dabeaf0f1d115cb21916caa0c6c0442a0b5c3188",
    "gpu_fast/mxfp4": "8a5c3a03ad378e47ac8111a45b2c7ce3a53dd5878cfbe6c19c37f8d67e542ec7",
    "gpu_fast/nvfp4": "f8550bba253f30b982912a758aa92afd6238bd8a9679333d49ffab883e90290a",
    "gpu_fast/int4": "b51d3123a5aca506cde4df2c748d549127d4f25ef5cc01625fb3a1f64215514f",
    "gpu_fast/tiny": "bfb96daef622b8e6e31637cc5477653e4edf5684cb7270c0d03ae3a2be0b79f3",
    "gpu_fast/empty": "99464b8f788cdfad6b71f0bebd90fd1bc57705a5e5d98a6f5c86eb119137ca9d",
    "segments/bf16_2d": "996cde02168c8c3ea3fe721244a954c9ebea2147c336741beec650b88f6b49f4",
    "segments/bf16_3d": "20c4d79ad2d4a941288edfc22db5ad34f6fd360437570f5a5adf7c59c98a92a7",
    "segments/bf16_1d": "d9275d74dfc23697a2bcb8193f717a4bc5e5c8352ffcf300328b64e5278b6f76",
    "segments/bf16_coarse": "a7db7f1b268c91f80d329f1c881e1da4faacc7b2d1390273aac3ef441617844e",
    "segments/f16_2d": "31c6bb5aba9272f4816a0a624dd223e031f27d33be0653ff2da0cde6eb6e5584",
    "segments/f32_2d": "57d015fbdd843dd5f1be3436324f4b2fdccba286b1dc5c60a233666f88fc7754",
    "segments/f32_emb": "56dc01a030d3e4a8b86325cb0fec0bd04df55cfe5a4772f4f08448a1e2481dd2",
    "segments/f64_2d": "926c60ea1e0702015df4bef423909dfce34ccabed6567e4655eca295999074f5",
    "segments/e4m3_2d": "ccc850561d872a0ab6594ecf0f86806be53b0291c0ba25461e5f28b34443a749",
    "segments/e4m3_wide": "31927acb9c7b83e41094bd6ed571729efae3df627a1338f963d2551661aca6ec",
    "segments/e5m2_1d": "1cb72d2cb55d0087d27d940ed8d09b9ccfbd944b5b85099669b107ea1daa3391",
    "segments/e8m0": "f12623b31c929ac08be2acb39dc6dfe08776cf2b96297d247e6249dad07a95b1",
    "segments/u8": "c4bb8b8816763d616975993b646d9f9880e02d68786a54cc83d15afe11f5b4f2",
    "segments/i8_2d": "3420e25ebb93246f992dc33b3f3f9bce52e103938ce63dc165913644680218ce",
    "segments/i16_ramp": "710b7826b05cdd3162eac84070905b611fd8692bfe68fdc89d388b5f17a223b3",
    "segments/i32_tokens": "b30601f55f814c1a2767bf357bbd1221b8d9e9c3e433ca85501750e92e4f4fb4",
    "segments/i64_positions": "ed4c84a1dad3ad12bd6987b612d3c5dfefc0e8dbb9318decaabe7dad1e4ff8eb",
    "segments/bool_mask": "c4e05d55946283ae3accd9b3e4bf8147d81f46cb691b42111f681fde4c58cdc0",
    "segments/constant": "69dbc23435cc19bb63601745559fe732021746bec25f565bb7c397399f246b6c",
    "segments/mxfp4": "846576f9d7a5e1bb8fd2cca78e24aed333ba8c09a602626fade1d57193ea0bfb",
    "segments/nvfp4": "38d85edf847cd3eb17d822c86c3e6ac5b6072522dc5ae86ec02e3cfb05634a11",
    "segments/int4": "a40e57244d25e871cfcd5c313a28f9e3e914cc009b73d19e7538098af49bb92d",
    "segments/tiny": "0c861719470d1275d6e6e1baec05951badaf2bdf942196f9e31ad20db343f71d",
    "segments/empty": "c04b7c8fb785934bf1896ee5c90e31ae96bf643c15fa41fb53375359176170b4",
}


@pytest.mark.parametrize("variant", sorted(_VARIANTS))
def test_outputs_are_unchanged(variant: str) -> None:
    got = {name: _digest(t, _VARIANTS[variant]) for name, t in _cases().items()}
    want = {name: HASHES[f"{variant}/{name}"] for name in got}
    assert got == want


if __name__ == "__main__":
    cases = _cases()
    sys.stdout.write("HASHES: dict[str, str] = {\n")
    for variant, options in sorted(_VARIANTS.items()):
        for name, tensors in cases.items():
            sys.stdout.write(f'    "{variant}/{name}": "{_digest(tensors, options)}",\n')
    sys.stdout.write("}\n")
