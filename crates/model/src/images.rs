//! Images in: decoding (PNG, JPEG, WebP, GIF's first frame) and the preprocessing of
//! transformers' Qwen2-VL image processor, which Qwen3.5 checkpoints name in
//! `preprocessor_config.json` — resize so both sides are multiples of patch × merge within the
//! configured pixel bounds, rescale, normalize, and cut into patches in the order the vision
//! tower reads them.

use std::io::Cursor;
use std::path::Path;

use image::imageops::FilterType;
use image::{ImageFormat, ImageReader};
/// The decoded images the processor takes, for callers that make their own.
pub use image::{Rgb, RgbImage};
use serde_json::Value;

use candle_core::{DType, Device, Tensor};

use crate::config::{Fields, VisionConfig};
use crate::error::{ModelError, Result};

/// The settings of `preprocessor_config.json` (`Qwen2VLImageProcessor` and its fast and PIL
/// twins).
#[derive(Clone, Debug, PartialEq)]
pub struct ImageProcessor {
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    /// Pixel bounds of the resized image (`size.shortest_edge` / `size.longest_edge`, or the
    /// older `min_pixels` / `max_pixels`).
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub do_resize: bool,
    pub rescale_factor: Option<f32>,
    /// Mean and std per channel, when normalizing.
    pub normalize: Option<([f32; 3], [f32; 3])>,
}

/// An image ready for the vision tower: its patches and their grid.
#[derive(Clone, Debug)]
pub struct PreparedImage {
    pub pixels: Pixels,
    /// Patches along time (1 for an image), height and width.
    pub grid: [usize; 3],
    /// A digest of the decoded pixels and the processor's settings (which decide the values the
    /// tower sees): what a prompt cache keys the image's tokens on.
    pub digest: u128,
}

/// An image's patches, patches in 2×2-merge block order (every merged token's patches adjacent),
/// each patch's values channel-major, then rows and columns of the patch.
#[derive(Clone, Debug)]
pub enum Pixels {
    /// The resized image's 8-bit levels `[patches, channels · patch · patch]` (one frame) and
    /// how they become values: normalized where the tower runs, so an image crosses to a GPU
    /// in 3 bytes a pixel instead of the values' 4 × the temporal patch.
    Levels { levels: Vec<u8>, normalization: Normalization },
    /// Values as the tower reads them, `[patches, channels · temporal_patch · patch · patch]`
    /// (the frame repeated): another processor's output.
    Values(Vec<f32>),
}

/// How an 8-bit level `x` becomes a pixel value, in f32 as the processor computes it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Normalization {
    /// `(x - shift[c]) / divisor[c]` for channel `c` (the rescale folded in).
    Standardize { shift: [f32; 3], divisor: [f32; 3] },
    /// `x · factor`.
    Scale(f32),
}

impl PreparedImage {
    fn patches(&self) -> usize {
        self.grid.iter().product()
    }

    /// Values per patch once each frame is repeated `temporal` times.
    pub fn patch_len(&self, temporal: usize) -> usize {
        match &self.pixels {
            Pixels::Levels { levels, .. } => levels.len() / self.patches().max(1) * temporal,
            Pixels::Values(values) => values.len() / self.patches().max(1),
        }
    }

    /// The values `[patches, patch_len(temporal)]` on `device`, in `dtype`: levels are
    /// normalized there in f32 (the processor's arithmetic, the same bits on any device) and
    /// each frame repeated `temporal` times.
    pub fn pixel_values(&self, temporal: usize, device: &Device, dtype: DType) -> Result<Tensor> {
        let n = self.patches();
        let values = match &self.pixels {
            Pixels::Levels { levels, normalization } => {
                let per_channel = levels.len() / n.max(1) / 3;
                let x = Tensor::from_slice(levels, (n, 3, per_channel), device)?.to_dtype(DType::F32)?;
                let x = match *normalization {
                    Normalization::Standardize { shift, divisor } => {
                        let channel = |v: [f32; 3]| Tensor::from_slice(&v, (1, 3, 1), device);
                        x.broadcast_sub(&channel(shift)?)?.broadcast_div(&channel(divisor)?)?
                    }
                    Normalization::Scale(factor) => x.broadcast_mul(&Tensor::new(&[factor], device)?)?,
                };
                x.unsqueeze(2)?
                    .broadcast_as((n, 3, temporal, per_channel))?
                    .contiguous()?
                    .reshape((n, 3 * temporal * per_channel))?
            }
            Pixels::Values(values) => Tensor::from_slice(values, (n, values.len() / n.max(1)), device)?,
        };
        Ok(values.to_dtype(dtype)?)
    }
}

/// What is refused before any pixel is decoded.
#[derive(Clone, Copy, Debug)]
pub struct ImageLimits {
    /// The most pixels (width × height) of an image as sent.
    pub max_pixels: u64,
}

impl Default for ImageLimits {
    fn default() -> Self {
        // 8192 × 8192: a photo of a large sensor, far past what any processor keeps.
        Self { max_pixels: 8192 * 8192 }
    }
}

impl ImageProcessor {
    /// The folder's `preprocessor_config.json`, if it has one.
    pub fn from_folder(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join("preprocessor_config.json");
        if !path.exists() {
            return Ok(None);
        }
        Self::from_json(&crate::error::read_json(&path)?, &path).map(Some)
    }

    pub fn from_json(root: &Value, path: &Path) -> Result<Self> {
        let map = root.as_object().ok_or_else(|| ModelError::file(path, "expected a JSON object"))?;
        let f = Fields { map, prefix: "", path: path.to_path_buf() };
        let kind = f.get("image_processor_type").and_then(Value::as_str).unwrap_or("Qwen2VLImageProcessor");
        if !kind.starts_with("Qwen2VLImageProcessor") {
            return Err(f.err("image_processor_type", format!("`{kind}` is not supported (only Qwen2VLImageProcessor)")));
        }
        let size = f.get("size").and_then(Value::as_object);
        let bound = |size_key: &str, legacy: &str, default: usize| -> Result<usize> {
            match size.and_then(|s| s.get(size_key)).or_else(|| f.get(legacy)) {
                None => Ok(default),
                Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| f.err(legacy, format!("expected an integer, found {v}"))),
            }
        };
        let channels = |name: &str, default: [f32; 3]| -> Result<[f32; 3]> {
            match f.get(name) {
                None => Ok(default),
                Some(v) => v
                    .as_array()
                    .and_then(|a| a.iter().map(|x| x.as_f64().map(|x| x as f32)).collect::<Option<Vec<_>>>())
                    .and_then(|a| <[f32; 3]>::try_from(a).ok())
                    .ok_or_else(|| f.err(name, format!("expected three numbers, found {v}"))),
            }
        };
        let processor = Self {
            patch_size: f.usize_or("patch_size", 14)?,
            temporal_patch_size: f.usize_or("temporal_patch_size", 2)?,
            merge_size: f.usize_or("merge_size", 2)?,
            min_pixels: bound("shortest_edge", "min_pixels", 56 * 56)?,
            max_pixels: bound("longest_edge", "max_pixels", 28 * 28 * 1280)?,
            do_resize: f.bool_or("do_resize", true)?,
            rescale_factor: match f.bool_or("do_rescale", true)? {
                true => Some(f.f64_or("rescale_factor", 1.0 / 255.0)? as f32),
                false => None,
            },
            // OpenAI CLIP's statistics are the processor's defaults.
            normalize: match f.bool_or("do_normalize", true)? {
                true => Some((
                    channels("image_mean", [0.481_454_66, 0.457_827_5, 0.408_210_73])?,
                    channels("image_std", [0.268_629_54, 0.261_302_6, 0.275_777_1])?,
                )),
                false => None,
            },
        };
        for (name, v) in [
            ("patch_size", processor.patch_size),
            ("temporal_patch_size", processor.temporal_patch_size),
            ("merge_size", processor.merge_size),
        ] {
            if v == 0 {
                return Err(f.err(name, "must be at least 1"));
            }
        }
        if processor.min_pixels > processor.max_pixels {
            return Err(
                f.err("size", format!("shortest_edge {} is above longest_edge {}", processor.min_pixels, processor.max_pixels))
            );
        }
        if let Some((_, std)) = processor.normalize.filter(|(_, std)| std.contains(&0.0)) {
            return Err(f.err("image_std", format!("{std:?} has a zero")));
        }
        Ok(processor)
    }

    /// `self`, when its patch and merge sizes are the tower's (`path` names the file in the
    /// error otherwise).
    pub fn checked_against(self, vision: &VisionConfig, path: &Path) -> Result<Self> {
        let pairs = [
            ("patch_size", self.patch_size, "patch_size", vision.patch_size),
            ("temporal_patch_size", self.temporal_patch_size, "temporal_patch_size", vision.temporal_patch_size),
            ("merge_size", self.merge_size, "spatial_merge_size", vision.spatial_merge_size),
        ];
        match pairs.into_iter().find(|(_, a, _, b)| a != b) {
            Some((name, a, theirs, b)) => {
                Err(ModelError::field(path, name, format!("{a} differs from config.json's vision_config.{theirs} {b}")))
            }
            None => Ok(self),
        }
    }

    /// Side lengths are multiples of this.
    fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// Decodes `bytes` (PNG, JPEG, WebP or GIF) and prepares the image. Every failure is a
    /// message fit to show the sender.
    pub fn prepare(&self, bytes: &[u8], limits: ImageLimits) -> std::result::Result<PreparedImage, String> {
        self.prepare_rgb(decode(bytes, limits)?)
    }

    /// Prepares an RGB image: resized as the processor resizes it (bicubic, antialiased), then
    /// rescaled, normalized and patchified.
    pub fn prepare_rgb(&self, image: RgbImage) -> std::result::Result<PreparedImage, String> {
        let digest = self.digest(&image);
        let image = self.resize(image)?;
        let (h, w) = (image.height() as usize, image.width() as usize);
        let pixels = Pixels::Levels { levels: self.patchify(&image), normalization: self.normalization() };
        Ok(PreparedImage { pixels, grid: [1, h / self.patch_size, w / self.patch_size], digest })
    }

    /// The image at the size the processor gives it: bicubic (Catmull-Rom, antialiased when
    /// shrinking, as PIL's and torchvision's are), within one level of transformers' pixels.
    pub fn resize(&self, image: RgbImage) -> std::result::Result<RgbImage, String> {
        let (w, h) = (image.width() as usize, image.height() as usize);
        if !self.do_resize {
            if h % self.factor() != 0 || w % self.factor() != 0 {
                return Err(format!(
                    "a {w}x{h} image is not a multiple of {} on each side and the processor does not resize",
                    self.factor()
                ));
            }
            return Ok(image);
        }
        let (rh, rw) = self.resized(h, w)?;
        // Rows first, rounded to 8 bits, then columns, as PIL and torchvision resample: where
        // the kernel overshoots, clipping between the passes changes the result by several
        // levels (the image crate alone resamples columns first and keeps floats between).
        let rows = if rw == w { image } else { image::imageops::resize(&image, rw as u32, h as u32, FilterType::CatmullRom) };
        Ok(if rh == h { rows } else { image::imageops::resize(&rows, rw as u32, rh as u32, FilterType::CatmullRom) })
    }

    /// The resized height and width (transformers' `smart_resize`): each side rounded to a
    /// multiple of the factor, then scaled down or up, keeping the aspect ratio, into the
    /// pixel bounds.
    pub fn resized(&self, height: usize, width: usize) -> std::result::Result<(usize, usize), String> {
        if height == 0 || width == 0 {
            return Err(format!("the image is {width}x{height} pixels"));
        }
        let (hf, wf, factor) = (height as f64, width as f64, self.factor() as f64);
        if hf.max(wf) / hf.min(wf) > 200.0 {
            return Err(format!("a {width}x{height} image has an aspect ratio above 200"));
        }
        let mut h = round_half_even(hf / factor) * factor;
        let mut w = round_half_even(wf / factor) * factor;
        if h * w > self.max_pixels as f64 {
            let beta = (hf * wf / self.max_pixels as f64).sqrt();
            h = factor.max((hf / beta / factor).floor() * factor);
            w = factor.max((wf / beta / factor).floor() * factor);
        } else if h * w < self.min_pixels as f64 {
            let beta = (self.min_pixels as f64 / (hf * wf)).sqrt();
            h = (hf * beta / factor).ceil() * factor;
            w = (wf * beta / factor).ceil() * factor;
        }
        Ok((h as usize, w as usize))
    }

    /// How levels become values: rescaled and normalized as the processor does (the rescale
    /// folded into the mean and std, as its fast path folds it).
    fn normalization(&self) -> Normalization {
        let rescale = self.rescale_factor.unwrap_or(1.0);
        match (self.rescale_factor, self.normalize) {
            (Some(_), Some((mean, std))) => {
                Normalization::Standardize { shift: mean.map(|m| m / rescale), divisor: std.map(|s| s / rescale) }
            }
            (None, Some((mean, std))) => Normalization::Standardize { shift: mean, divisor: std },
            (_, None) => Normalization::Scale(rescale),
        }
    }

    /// The image's levels in patches, in the tower's order: merged blocks row-major, within a
    /// block its `merge × merge` patches row-major; each patch channel-major, then rows and
    /// columns of the patch (one frame; the tower repeats it `temporal_patch_size` times).
    fn patchify(&self, image: &RgbImage) -> Vec<u8> {
        let (p, m) = (self.patch_size, self.merge_size);
        let (gh, gw) = (image.height() as usize / p, image.width() as usize / p);
        let mut out = Vec::with_capacity(gh * gw * 3 * p * p);
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for ih in 0..m {
                    for iw in 0..m {
                        let (y0, x0) = ((bh * m + ih) * p, (bw * m + iw) * p);
                        for c in 0..3 {
                            for y in y0..y0 + p {
                                out.extend((x0..x0 + p).map(|x| image.get_pixel(x as u32, y as u32).0[c]));
                            }
                        }
                    }
                }
            }
        }
        out
    }
}

/// Python's `round`: halves go to the even neighbour.
fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - x.signum()
    } else {
        r
    }
}

/// The media type of an encoded image, from its first bytes: `image/png`, `image/jpeg`,
/// `image/webp` or `image/gif` (the kinds [`decode`] takes), or `None`.
pub fn media_type(bytes: &[u8]) -> Option<&'static str> {
    match image::guess_format(bytes).ok()? {
        ImageFormat::Png => Some("image/png"),
        ImageFormat::Jpeg => Some("image/jpeg"),
        ImageFormat::WebP => Some("image/webp"),
        ImageFormat::Gif => Some("image/gif"),
        _ => None,
    }
}

/// Decodes an encoded image (its format recognised from its bytes) to RGB, refusing one whose
/// header declares more than `limits` allows before decoding its pixels. Transparent pixels
/// are composited over white, as transformers' `convert_to_rgb` does.
pub fn decode(bytes: &[u8], limits: ImageLimits) -> std::result::Result<RgbImage, String> {
    let guessed =
        ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| format!("cannot read the image: {e}"))?;
    let format = match guessed.format() {
        Some(f @ (ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP | ImageFormat::Gif)) => f,
        Some(other) => return Err(format!("{other:?} images are not supported (PNG, JPEG, WebP or GIF)")),
        None => return Err("the data is not a PNG, JPEG, WebP or GIF image".into()),
    };
    let reader = || ImageReader::with_format(Cursor::new(bytes), format);
    let (w, h) = reader().into_dimensions().map_err(|e| format!("cannot read the {format:?} header: {e}"))?;
    if w == 0 || h == 0 {
        return Err(format!("the image is {w}x{h} pixels"));
    }
    if w as u64 * h as u64 > limits.max_pixels {
        return Err(format!("the image is {w}x{h} pixels, more than the {} allowed", limits.max_pixels));
    }
    // The decoder holds to the header's size and a buffer of that size (a file whose frames or
    // chunks claim more is refused, not decoded).
    let mut bounds = image::Limits::default();
    bounds.max_image_width = Some(w);
    bounds.max_image_height = Some(h);
    bounds.max_alloc = Some(w as u64 * h as u64 * 16 + (1 << 20));
    let mut reader = reader();
    reader.limits(bounds);
    let decoded = reader.decode().map_err(|e| format!("cannot decode the {format:?} image: {e}"))?;
    Ok(if decoded.color().has_alpha() {
        let rgba = decoded.to_rgba8();
        RgbImage::from_fn(w, h, |x, y| {
            let [r, g, b, a] = rgba.get_pixel(x, y).0;
            let over = |c: u8| ((c as u32 * a as u32 + 255 * (255 - a as u32) + 127) / 255) as u8;
            image::Rgb([over(r), over(g), over(b)])
        })
    } else {
        decoded.to_rgb8()
    })
}

impl ImageProcessor {
    /// 128-bit xxh3 over the settings, the dimensions and the RGB bytes.
    fn digest(&self, image: &RgbImage) -> u128 {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(format!("{self:?}").as_bytes());
        h.update(&image.width().to_le_bytes());
        h.update(&image.height().to_le_bytes());
        h.update(image.as_raw());
        h.digest128()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn processor() -> ImageProcessor {
        let cfg = serde_json::json!({"patch_size": 4, "merge_size": 2, "size": {"shortest_edge": 256, "longest_edge": 4096}});
        ImageProcessor::from_json(&cfg, Path::new("preprocessor_config.json")).unwrap()
    }

    fn png(w: u32, h: u32) -> Vec<u8> {
        let mut out = Vec::new();
        RgbImage::new(w, h).write_to(&mut Cursor::new(&mut out), ImageFormat::Png).unwrap();
        out
    }

    #[test]
    fn sizes_follow_smart_resize() {
        let p = processor();
        // Halves round to even, as Python's round: 100 / 8 = 12.5 -> 12; 36 / 8 = 4.5 -> 4.
        assert_eq!(p.resized(36, 100), Ok((32, 96)));
        assert_eq!(p.resized(24, 32), Ok((24, 32)));
        // Above max_pixels: scaled down, floors; below min_pixels: scaled up, ceilings.
        assert_eq!(p.resized(70, 100), Ok((48, 72)));
        assert_eq!(p.resized(5, 7), Ok((16, 24)));
        assert!(p.resized(1, 201).unwrap_err().contains("aspect ratio"));
    }

    #[test]
    fn bad_images_are_refused_with_a_reason() {
        let p = processor();
        let limits = ImageLimits::default();
        let whole = png(16, 16);
        let cases: [(&[u8], &str); 4] = [
            (&whole[..whole.len() / 2], "cannot decode"),
            (b"GIF89a", "cannot read the Gif header"),
            (b"not an image at all", "not a PNG, JPEG, WebP or GIF"),
            (b"BM\x00\x00", "Bmp images are not supported"),
        ];
        for (bytes, reason) in cases {
            let err = p.prepare(bytes, limits).unwrap_err();
            assert!(err.contains(reason), "{err:?} should say {reason:?}");
        }
        let err = p.prepare(&png(300, 300), ImageLimits { max_pixels: 256 * 256 }).unwrap_err();
        assert!(err.contains("300x300 pixels, more than the 65536 allowed"), "{err}");
        let prepared = p.prepare(&whole, limits).unwrap();
        assert_eq!(prepared.grid, [1, 4, 4]);
        // 16 patches of 4x4, 3 channels, the frame twice.
        assert_eq!(prepared.patch_len(2), 3 * 2 * 4 * 4);
        assert_eq!(prepared.pixel_values(2, &Device::Cpu, DType::F32).unwrap().dims(), [16, 3 * 2 * 4 * 4]);
    }

    #[test]
    fn the_digest_tells_pixels_apart() {
        let p = processor();
        let a = p.prepare_rgb(RgbImage::new(16, 16)).unwrap();
        let mut other = RgbImage::new(16, 16);
        other.put_pixel(3, 5, image::Rgb([0, 0, 1]));
        assert_ne!(a.digest, p.prepare_rgb(other).unwrap().digest);
        assert_eq!(a.digest, p.prepare_rgb(RgbImage::new(16, 16)).unwrap().digest);
        // Another processor gives the same file other values: another key.
        let shifted = ImageProcessor { normalize: Some(([0.4; 3], [0.5; 3])), ..p };
        assert_ne!(a.digest, shifted.prepare_rgb(RgbImage::new(16, 16)).unwrap().digest);
    }
}
