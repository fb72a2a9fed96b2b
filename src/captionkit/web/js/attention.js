// The word-by-word attention view shared by both pages: the caption as buttons; hovering,
// focusing or tapping a word lays its attention weights (a grid over the photo, upsampled
// smoothly by the canvas) over the photo.

export function showResult(root, photoUrl, result) {
  const img = root.querySelector(".photo");
  const canvas = root.querySelector(".overlay");
  const words = root.querySelector(".words");
  const caption = root.querySelector(".caption");
  caption.textContent = result.words.join(" ");
  img.src = photoUrl;
  words.replaceChildren();
  const select = (i) => {
    words.querySelectorAll(".word").forEach((b, j) => b.classList.toggle("active", j === i));
    drawAttention(canvas, img, result.attention[i], result.grid);
    canvas.dataset.word = result.words[i];
    canvas.dataset.index = String(i);
  };
  result.words.forEach((w, i) => {
    const b = document.createElement("button");
    b.type = "button";
    b.className = "word";
    b.textContent = w;
    b.addEventListener("mouseenter", () => select(i));
    b.addEventListener("focus", () => select(i));
    b.addEventListener("click", () => select(i));
    words.appendChild(b);
  });
  const clear = () => { canvas.getContext("2d").clearRect(0, 0, canvas.width, canvas.height); delete canvas.dataset.word; };
  words.onmouseleave = clear;
  img.onload = clear;
}

export function drawAttention(canvas, img, weights, grid) {
  const [gh, gw] = grid;
  const w = img.clientWidth || img.naturalWidth, h = img.clientHeight || img.naturalHeight;
  canvas.width = w;
  canvas.height = h;
  canvas.style.width = `${w}px`;
  canvas.style.height = `${h}px`;
  // Stretched from the least to the most attended cell, as the Python figures do: soft
  // attention is often spread thinly, and scaled by its maximum alone most cells stay clear.
  const max = Math.max(...weights), min = Math.min(...weights);
  const range = max - min || 1;
  const small = document.createElement("canvas");
  small.width = gw;
  small.height = gh;
  const sctx = small.getContext("2d");
  const cells = sctx.createImageData(gw, gh);
  for (let i = 0; i < gh * gw; i++) {
    // dark where the model did not look, clear where it did
    cells.data[i * 4 + 3] = Math.round(215 * (1 - (weights[i] - min) / range));
  }
  sctx.putImageData(cells, 0, 0);
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, w, h);
  ctx.imageSmoothingEnabled = true;
  ctx.imageSmoothingQuality = "high";
  ctx.drawImage(small, 0, 0, w, h);
}

// Drop zone + file input -> onFile(file)
export function fileInput(zone, input, onFile) {
  input.addEventListener("change", () => input.files[0] && onFile(input.files[0]));
  zone.addEventListener("dragover", (e) => { e.preventDefault(); zone.classList.add("over"); });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("over");
    if (e.dataTransfer.files[0]) onFile(e.dataTransfer.files[0]);
  });
}
