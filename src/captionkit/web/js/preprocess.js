// Photo -> encoder input, as captionkit.images.to_tensor does it in Python: resize the RGB
// photo to size x size with Pillow's bicubic filter, then (rgb / 255 - mean) / std, NCHW.
//
// The resize is a line-by-line port of Pillow's Resample.c for 8-bit images (the cubic
// filter with a = -0.5, its support widened by the scale when shrinking, coefficients
// normalised and rounded to 22-bit fixed point, a horizontal pass then a vertical pass, each
// rounded and clipped to 0..255, in Pillow's order), so it gives byte-identical pixels; a canvas's drawImage
// resize does not (tests/test_web.py compares this function with Pillow).

const PRECISION_BITS = 32 - 8 - 2;

function bicubicFilter(x) {
  const a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

function precomputeCoeffs(inSize, outSize) {
  const support0 = 2.0; // the bicubic filter's support
  let scale = inSize / outSize;
  let filterscale = scale < 1.0 ? 1.0 : scale;
  const support = support0 * filterscale;
  const ksize = Math.ceil(support) * 2 + 1;
  const bounds = new Int32Array(outSize * 2);
  const kk = new Int32Array(outSize * ksize);
  const k = new Float64Array(ksize);
  for (let xx = 0; xx < outSize; xx++) {
    const center = (xx + 0.5) * scale;
    let ww = 0.0;
    const ss = 1.0 / filterscale;
    let xmin = Math.trunc(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    let xmax = Math.trunc(center + support + 0.5);
    if (xmax > inSize) xmax = inSize;
    xmax -= xmin;
    for (let x = 0; x < xmax; x++) {
      const w = bicubicFilter((x + xmin - center + 0.5) * ss);
      k[x] = w;
      ww += w;
    }
    for (let x = 0; x < ksize; x++) {
      let v = x < xmax ? (ww !== 0.0 ? k[x] / ww : k[x]) : 0;
      // normalize_coeffs_8bpc: round half away from zero, truncating like C's (int)
      kk[xx * ksize + x] = v < 0 ? Math.trunc(-0.5 + v * (1 << PRECISION_BITS))
                                 : Math.trunc(0.5 + v * (1 << PRECISION_BITS));
    }
    bounds[xx * 2] = xmin;
    bounds[xx * 2 + 1] = xmax;
  }
  return { ksize, bounds, kk };
}

function clip8(v) {
  if (v >= (1 << PRECISION_BITS) * 256) return 255;
  if (v <= 0) return 0;
  return Math.floor(v / (1 << PRECISION_BITS));
}

// src: Uint8Array RGB (3 bytes per pixel), w x h -> Uint8Array RGB, outW x h
function resizeHorizontal(src, w, h, outW) {
  const { ksize, bounds, kk } = precomputeCoeffs(w, outW);
  const out = new Uint8Array(outW * h * 3);
  const half = 1 << (PRECISION_BITS - 1);
  for (let y = 0; y < h; y++) {
    const row = y * w * 3;
    for (let xx = 0; xx < outW; xx++) {
      const xmin = bounds[xx * 2], xmax = bounds[xx * 2 + 1], kb = xx * ksize;
      let s0 = half, s1 = half, s2 = half;
      for (let x = 0; x < xmax; x++) {
        const c = kk[kb + x], p = row + (x + xmin) * 3;
        s0 += src[p] * c; s1 += src[p + 1] * c; s2 += src[p + 2] * c;
      }
      const o = (y * outW + xx) * 3;
      out[o] = clip8(s0); out[o + 1] = clip8(s1); out[o + 2] = clip8(s2);
    }
  }
  return out;
}

function resizeVertical(src, w, h, outH) {
  const { ksize, bounds, kk } = precomputeCoeffs(h, outH);
  const out = new Uint8Array(w * outH * 3);
  const half = 1 << (PRECISION_BITS - 1);
  for (let yy = 0; yy < outH; yy++) {
    const ymin = bounds[yy * 2], ymax = bounds[yy * 2 + 1], kb = yy * ksize;
    for (let x = 0; x < w; x++) {
      let s0 = half, s1 = half, s2 = half;
      for (let y = 0; y < ymax; y++) {
        const c = kk[kb + y], p = ((y + ymin) * w + x) * 3;
        s0 += src[p] * c; s1 += src[p + 1] * c; s2 += src[p + 2] * c;
      }
      const o = (yy * w + x) * 3;
      out[o] = clip8(s0); out[o + 1] = clip8(s1); out[o + 2] = clip8(s2);
    }
  }
  return out;
}

// Pillow's Image.resize((outW, outH), BICUBIC) of an RGB image (Uint8Array, 3 bytes/pixel).
// Pillow (13) runs the vertical pass first when the height shrinks by more than twice as many
// pixels as the width does; the order changes the rounding between the passes.
export function resizeBicubic(rgb, w, h, outW, outH) {
  let img = rgb;
  const verticalFirst = h - outH > 0 && h - outH > (w - outW) * 2;
  if (verticalFirst) {
    if (outH !== h) img = resizeVertical(img, w, h, outH);
    if (outW !== w) img = resizeHorizontal(img, w, outH, outW);
  } else {
    if (outW !== w) img = resizeHorizontal(img, w, h, outW);
    if (outH !== h) img = resizeVertical(img, outW, h, outH);
  }
  return img === rgb ? rgb.slice() : img;
}

// RGBA pixels (e.g. canvas ImageData) -> RGB bytes, transparent pixels composited on white as
// captionkit.images.to_rgb does (identical for opaque photos).
export function rgbaToRgb(rgba, w, h) {
  const out = new Uint8Array(w * h * 3);
  for (let i = 0, j = 0; i < w * h * 4; i += 4, j += 3) {
    const a = rgba[i + 3];
    for (let c = 0; c < 3; c++) {
      out[j + c] = a === 255 ? rgba[i + c] : Math.round((rgba[i + c] * a + 255 * (255 - a)) / 255);
    }
  }
  return out;
}

// RGB bytes of the photo -> Float32Array (1, 3, size, size), the manifest's preprocessing.
export function toTensorData(rgb, w, h, pre) {
  if (pre.resample !== "bicubic") throw new Error(`resample ${pre.resample} is not implemented`);
  const S = pre.size;
  const img = resizeBicubic(rgb, w, h, S, S);
  const out = new Float32Array(3 * S * S);
  for (let c = 0; c < 3; c++) {
    const mean = Math.fround(pre.mean[c]), std = Math.fround(pre.std[c]);
    for (let i = 0; i < S * S; i++) {
      const x = Math.fround(img[i * 3 + c] / 255);
      out[c * S * S + i] = Math.fround(Math.fround(x - mean) / std);
    }
  }
  return out;
}
