//! Two real models written with tch's `nn`, for the benchmarks: a GPT-style decoder
//! (token and position embeddings, pre-norm blocks of causal self-attention through
//! libtorch's scaled-dot-product attention and a GELU MLP) and a ResNet-style conv net
//! with batch norm (ResNet-18's basic blocks, for 32x32 images). [`PY_MODELS`] is the
//! same two models in PyTorch, layer for layer, for the baseline.

use torchtools::tch::nn::{self, Module, ModuleT};
use torchtools::tch::{Kind, Tensor};
use torchtools::tracker::{Tracker, TrackerConfig};

/// The toolkit rows' tracker, the CPU bench's and the GPU bench's alike: this process
/// and its children sampled every 100 ms; none when `on` is false.
pub(crate) fn kit_tracker(on: bool) -> torchtools::tracker::Result<Option<Tracker>> {
    on.then(|| {
        Tracker::start(TrackerConfig {
            interval: std::time::Duration::from_millis(100),
            ..TrackerConfig::default()
        })
    })
    .transpose()
}

/// The decoder's shape.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GptConfig {
    pub(crate) vocab: i64,
    pub(crate) context: i64,
    pub(crate) layers: i64,
    pub(crate) heads: i64,
    pub(crate) width: i64,
}

impl GptConfig {
    /// About 85M parameters in its blocks (GPT-2 small's blocks, a 2048-token vocabulary).
    pub(crate) const GPU: GptConfig = GptConfig {
        vocab: 2048,
        context: 512,
        layers: 12,
        heads: 12,
        width: 768,
    };

    /// About 4.2M parameters (4 blocks of 256, a 2048-token vocabulary, 128 positions),
    /// for the CPU.
    pub(crate) const CPU: GptConfig = GptConfig {
        vocab: 2048,
        context: 128,
        layers: 4,
        heads: 4,
        width: 256,
    };

    /// The shape as [`PY_MODELS`] reads it from `TT_GPT_SHAPE`.
    pub(crate) fn py_shape(&self) -> String {
        let c = self;
        format!(
            "{},{},{},{},{}",
            c.vocab, c.context, c.layers, c.heads, c.width
        )
    }
}

struct Block {
    ln1: nn::LayerNorm,
    qkv: nn::Linear,
    proj: nn::Linear,
    ln2: nn::LayerNorm,
    fc: nn::Linear,
    out: nn::Linear,
    heads: i64,
}

impl Block {
    fn new(p: nn::Path, c: &GptConfig) -> Block {
        let d = c.width;
        Block {
            ln1: nn::layer_norm(&p / "ln1", vec![d], Default::default()),
            qkv: nn::linear(&p / "qkv", d, 3 * d, Default::default()),
            proj: nn::linear(&p / "proj", d, d, Default::default()),
            ln2: nn::layer_norm(&p / "ln2", vec![d], Default::default()),
            fc: nn::linear(&p / "fc", d, 4 * d, Default::default()),
            out: nn::linear(&p / "out", 4 * d, d, Default::default()),
            heads: c.heads,
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let (b, t, d) = x.size3().unwrap_or((0, 0, 0));
        let split = |y: &Tensor| y.view([b, t, self.heads, d / self.heads]).transpose(1, 2);
        let qkv = self.qkv.forward(&self.ln1.forward(x)).split(d, -1);
        let y = Tensor::scaled_dot_product_attention(
            &split(&qkv[0]),
            &split(&qkv[1]),
            &split(&qkv[2]),
            None::<Tensor>,
            0.0,
            true,
            None::<f64>,
            false,
        );
        let x = x + self
            .proj
            .forward(&y.transpose(1, 2).contiguous().view([b, t, d]));
        let h = self.fc.forward(&self.ln2.forward(&x)).gelu("none");
        &x + self.out.forward(&h)
    }
}

/// A GPT-style decoder: logits for every position of a batch of token sequences.
pub(crate) struct Gpt {
    wte: nn::Embedding,
    wpe: nn::Embedding,
    blocks: Vec<Block>,
    ln_f: nn::LayerNorm,
    head: nn::Linear,
}

impl Gpt {
    pub(crate) fn new(p: &nn::Path, c: &GptConfig) -> Gpt {
        Gpt {
            wte: nn::embedding(p / "wte", c.vocab, c.width, Default::default()),
            wpe: nn::embedding(p / "wpe", c.context, c.width, Default::default()),
            blocks: (0..c.layers).map(|i| Block::new(p / "h" / i, c)).collect(),
            ln_f: nn::layer_norm(p / "ln_f", vec![c.width], Default::default()),
            head: nn::linear(p / "head", c.width, c.vocab, Default::default()),
        }
    }

    /// Next-token cross-entropy of `tokens` (`[batch, context + 1]`), in float32.
    pub(crate) fn loss(&self, tokens: &Tensor) -> Tensor {
        let t = tokens.size()[1] - 1;
        let (x, y) = (tokens.narrow(1, 0, t), tokens.narrow(1, 1, t));
        let pos = Tensor::arange(t, (Kind::Int64, tokens.device()));
        let mut h = self.wte.forward(&x) + self.wpe.forward(&pos);
        for b in &self.blocks {
            h = b.forward(&h);
        }
        let logits = self.head.forward(&self.ln_f.forward(&h));
        let v = logits.size()[2];
        logits
            .to_kind(Kind::Float)
            .view([-1, v])
            .cross_entropy_for_logits(&y.reshape([-1]))
    }
}

fn conv(p: nn::Path, i: i64, o: i64, k: i64, stride: i64) -> nn::Conv2D {
    let cfg = nn::ConvConfig {
        stride,
        padding: k / 2,
        bias: false,
        ..Default::default()
    };
    nn::conv2d(p, i, o, k, cfg)
}

struct Basic {
    c1: nn::Conv2D,
    b1: nn::BatchNorm,
    c2: nn::Conv2D,
    b2: nn::BatchNorm,
    down: Option<(nn::Conv2D, nn::BatchNorm)>,
}

impl Basic {
    fn new(p: nn::Path, i: i64, o: i64, stride: i64) -> Basic {
        Basic {
            c1: conv(&p / "c1", i, o, 3, stride),
            b1: nn::batch_norm2d(&p / "b1", o, Default::default()),
            c2: conv(&p / "c2", o, o, 3, 1),
            b2: nn::batch_norm2d(&p / "b2", o, Default::default()),
            down: (stride != 1 || i != o).then(|| {
                (
                    conv(&p / "dc", i, o, 1, stride),
                    nn::batch_norm2d(&p / "db", o, Default::default()),
                )
            }),
        }
    }

    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let y = self.b1.forward_t(&self.c1.forward(x), train).relu();
        let y = self.b2.forward_t(&self.c2.forward(&y), train);
        let skip = match &self.down {
            Some((c, b)) => b.forward_t(&c.forward(x), train),
            None => x.shallow_clone(),
        };
        (y + skip).relu()
    }
}

/// A ResNet-18-style net for 32x32 images (CIFAR's stem: one 3x3 convolution).
pub(crate) struct ResNet {
    stem: nn::Conv2D,
    bn: nn::BatchNorm,
    blocks: Vec<Basic>,
    fc: nn::Linear,
}

impl ResNet {
    pub(crate) fn new(p: &nn::Path, classes: i64) -> ResNet {
        let mut blocks = Vec::new();
        let mut i = 64;
        for (n, o) in [64, 128, 256, 512].into_iter().enumerate() {
            for k in 0..2 {
                let stride = if n > 0 && k == 0 { 2 } else { 1 };
                blocks.push(Basic::new(p / format!("layer{n}_{k}"), i, o, stride));
                i = o;
            }
        }
        ResNet {
            stem: conv(p / "stem", 3, 64, 3, 1),
            bn: nn::batch_norm2d(p / "bn", 64, Default::default()),
            blocks,
            fc: nn::linear(p / "fc", 512, classes, Default::default()),
        }
    }

    /// Cross-entropy of the classes of `images` (`[batch, 3, 32, 32]`), in float32.
    pub(crate) fn loss(&self, images: &Tensor, labels: &Tensor) -> Tensor {
        let mut h = self.bn.forward_t(&self.stem.forward(images), true).relu();
        for b in &self.blocks {
            h = b.forward_t(&h, true);
        }
        let h = h.adaptive_avg_pool2d([1, 1]).flatten(1, -1);
        self.fc
            .forward(&h)
            .to_kind(Kind::Float)
            .cross_entropy_for_logits(labels)
    }
}

/// The same models in PyTorch eager, and a training loop printing
/// `SECONDS_PER_STEP PEAK_ALLOCATED_BYTES`: `python -c PY_MODELS gpt|resnet BATCH STEPS`.
/// AdamW (lr 1e-4) and bf16 autocast, as the Rust side. `TT_MODELS_DEVICE=cpu` trains on
/// the CPU in float32 (the peak printed is 0: no allocator statistics there), and
/// `TT_GPT_SHAPE` gives the decoder's shape (`GptConfig::py_shape`; GPT-2 small's
/// blocks when unset). `gpt-ckpt BATCH STEPS DIR`
/// times checkpoints of the model and its optimizer instead (PyTorch's
/// `torch.distributed.checkpoint.async_save` and an fsynced `torch.save`), and the load of
/// the last `torch.save` file onto the GPU (`torch.load(map_location='cuda:0')`):
/// `STATE_BYTES ASYNC_STALL ASYNC_DURABLE SAVE_STALL LOAD` in bytes and seconds, medians
/// of three.
pub(crate) const PY_MODELS: &str = r#"
import os, sys, time, torch, torch.nn as nn, torch.nn.functional as F
which, batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dev = os.environ.get('TT_MODELS_DEVICE', 'cuda')
shape = [int(v) for v in os.environ.get('TT_GPT_SHAPE', '2048,512,12,12,768').split(',')]
sync = torch.cuda.synchronize if dev == 'cuda' else (lambda: None)
class Block(nn.Module):
    def __init__(s, d, h):
        super().__init__(); s.h = h
        s.ln1 = nn.LayerNorm(d); s.qkv = nn.Linear(d, 3 * d); s.proj = nn.Linear(d, d)
        s.ln2 = nn.LayerNorm(d); s.fc = nn.Linear(d, 4 * d); s.out = nn.Linear(4 * d, d)
    def forward(s, x):
        b, t, d = x.shape
        q, k, v = s.qkv(s.ln1(x)).split(d, -1)
        sp = lambda y: y.view(b, t, s.h, d // s.h).transpose(1, 2)
        y = F.scaled_dot_product_attention(sp(q), sp(k), sp(v), is_causal=True)
        x = x + s.proj(y.transpose(1, 2).contiguous().view(b, t, d))
        return x + s.out(F.gelu(s.fc(s.ln2(x))))
class Gpt(nn.Module):
    def __init__(s, vocab=2048, context=512, layers=12, heads=12, d=768):
        super().__init__()
        s.wte = nn.Embedding(vocab, d); s.wpe = nn.Embedding(context, d)
        s.h = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        s.ln_f = nn.LayerNorm(d); s.head = nn.Linear(d, vocab)
    def loss(s, tokens):
        x, y = tokens[:, :-1], tokens[:, 1:]
        h = s.wte(x) + s.wpe(torch.arange(x.shape[1], device=x.device))
        for b in s.h: h = b(h)
        logits = s.head(s.ln_f(h))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
class Basic(nn.Module):
    def __init__(s, i, o, stride):
        super().__init__()
        s.c1 = nn.Conv2d(i, o, 3, stride, 1, bias=False); s.b1 = nn.BatchNorm2d(o)
        s.c2 = nn.Conv2d(o, o, 3, 1, 1, bias=False); s.b2 = nn.BatchNorm2d(o)
        s.down = None
        if stride != 1 or i != o:
            s.down = nn.Sequential(nn.Conv2d(i, o, 1, stride, 0, bias=False), nn.BatchNorm2d(o))
    def forward(s, x):
        y = F.relu(s.b1(s.c1(x))); y = s.b2(s.c2(y))
        return F.relu(y + (s.down(x) if s.down is not None else x))
class ResNet(nn.Module):
    def __init__(s, classes=10):
        super().__init__()
        s.stem = nn.Conv2d(3, 64, 3, 1, 1, bias=False); s.bn = nn.BatchNorm2d(64)
        blocks, i = [], 64
        for n, o in enumerate([64, 128, 256, 512]):
            for k in range(2):
                blocks.append(Basic(i, o, 2 if n > 0 and k == 0 else 1)); i = o
        s.blocks = nn.Sequential(*blocks); s.fc = nn.Linear(512, classes)
    def loss(s, images, labels):
        h = s.blocks(F.relu(s.bn(s.stem(images))))
        return F.cross_entropy(s.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1)).float(), labels)
torch.manual_seed(0)
model = (Gpt(*shape) if which.startswith('gpt') else ResNet()).to(dev).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
def data():
    if which.startswith('gpt'):
        return (torch.randint(shape[0], (batch, shape[1] + 1), device=dev),)
    return (torch.randn(batch, 3, 32, 32, device=dev), torch.randint(10, (batch,), device=dev))
def step():
    args = data()
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == 'cuda'):
        loss = model.loss(*args)
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
for _ in range(5): step()
if not which.endswith('-ckpt'):
    sync()
    if dev == 'cuda': torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(steps): step()
    sync()
    peak = torch.cuda.max_memory_allocated() if dev == 'cuda' else 0
    print((time.perf_counter() - t) / steps, peak)
    sys.exit(0)
import os, statistics, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
out = sys.argv[4]
dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
def timed(f):
    # The call, then one training step: what the checkpoint costs the training loop.
    torch.cuda.synchronize(); t = time.perf_counter()
    r = f(); step(); torch.cuda.synchronize()
    return time.perf_counter() - t, r
plain = statistics.median(timed(lambda: None)[0] for _ in range(5))
def fsynced_save(path):
    with open(path, 'wb') as fh:
        torch.save({'model': model.state_dict(), 'optim': opt.state_dict()}, fh)
        fh.flush(); os.fsync(fh.fileno())
a_stall, a_durable, s_stall = [], [], []
for i in range(3):
    m, o = get_state_dict(model, opt)
    t0 = time.perf_counter()
    took, fut = timed(lambda: dcp.async_save({'model': m, 'optim': o}, checkpoint_id=f'{out}/dcp{i}'))
    fut.result()
    a_durable.append(time.perf_counter() - t0); a_stall.append(took - plain)
    took, _ = timed(lambda: fsynced_save(f'{out}/save{i}.pt'))
    s_stall.append(took - plain)
state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
state += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
def load():
    torch.cuda.synchronize(); t = time.perf_counter()
    sd = torch.load(f'{out}/save2.pt', map_location='cuda:0', weights_only=True)
    torch.cuda.synchronize(); took = time.perf_counter() - t
    del sd; return took
load()
med = statistics.median
print(state, med(a_stall), med(a_durable), med(s_stall), med(load() for _ in range(3)))
"#;

/// Runs the baseline Python (`TORCHTOOLS_PYTHON`, default `python3`) with `args` and
/// the variables `envs`; its standard output, or an error naming `what` with Python's
/// standard error.
pub(crate) fn python_baseline(
    what: &str,
    args: &[&str],
    envs: &[(&str, &str)],
) -> Result<String, String> {
    let python = std::env::var("TORCHTOOLS_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(&python)
        .args(args)
        .envs(envs.iter().copied())
        .output()
        .map_err(|e| format!("cannot run {python}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "the PyTorch {what} baseline failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
