import time, torch
import fp4fuse
from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.kernels.triton import mm, mm_decode, quant
def q(r,k):
    x=torch.randn(r,k,device="cuda"); gs=nvfp4.global_scale_from_amax(x.abs().amax()).reshape(1); a,s=torch.ops.fp4fuse.scaled_fp4_quant(x,gs); return a,s,gs
a,sa,ga=q(16,8192); b,sb,gb=q(8192,8192); alpha=(1/(ga*gb)).reshape(1)
x=torch.randn(16,8192,device="cuda",dtype=torch.bfloat16)
def host(name, fn, n=200):
    fn(); torch.cuda.synchronize()
    t=time.perf_counter()
    for _ in range(n): fn()
    h=(time.perf_counter()-t)/n*1e6; torch.cuda.synchronize(); w=(time.perf_counter()-t)/n*1e6
    print(f"{name}: {h:.1f} us/call host, {w:.1f} us/call wall", flush=True)
host("op mm_fp4", lambda: torch.ops.fp4fuse.mm_fp4(a,b,sa,sb,alpha,torch.bfloat16))
host("mm_fp4_decode", lambda: mm_decode.mm_fp4_decode(a,b,sa,sb,alpha,torch.bfloat16))
host("quant op", lambda: torch.ops.fp4fuse.scaled_fp4_quant(x, ga))
host("quant launcher", lambda: quant.scaled_fp4_quant_triton(x, ga))
host("torch.mm bf16", lambda: torch.mm(x, x.t()))
w1=torch.randn(8192,device="cuda",dtype=torch.bfloat16)
qw,sw,gw=q(8192,8192)
def mlp(x):
    amax=x.abs().amax().float().reshape(1); gs=nvfp4.global_scale_from_amax(amax)
    qx,sx=torch.ops.fp4fuse.scaled_fp4_quant(x,gs)
    y=torch.ops.fp4fuse.mm_fp4(qx,qw,sx,sw,torch.reciprocal(gs*gw),torch.bfloat16)
    return torch.ops.fp4fuse.rms_norm(y, w1, 1e-6)
ref=mlp(x)
for name, fn in (("eager", mlp), ("compiled", torch.compile(mlp)),
                 ("compiled+lowered", torch.compile(mlp, options={"post_grad_custom_post_pass": fp4fuse.FusionPass()}))):
    y=fn(x)
    print(name, "bitwise equal to eager:", torch.equal(y, ref))
    host(f"mlp {name}", lambda: fn(x))
