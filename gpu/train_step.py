"""A real (small) training loop for the overhead comparison.

    python3 gpu/train_step.py [--steps 200] [--warmup 20] [--batch 128]

A ResNet-ish convnet on random 3x64x64 images (SGD, cross-entropy, cuDNN
benchmark on). After the warm-up it times --steps optimizer steps with a
synchronize at both ends and prints
    RESULT steps=N seconds=S ms_per_step=M final_loss=L
"""

import argparse
import time

import torch
import torch.nn as nn

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--warmup", type=int, default=20)
ap.add_argument("--batch", type=int, default=128)
args = ap.parse_args()


def block(cin, cout, stride):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


torch.manual_seed(0)
torch.backends.cudnn.benchmark = True
dev = torch.device("cuda")
model = nn.Sequential(block(3, 64, 1), block(64, 128, 2), block(128, 256, 2), block(256, 256, 2),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()
x = torch.randn(args.batch, 3, 64, 64, device=dev)
y = torch.randint(0, 10, (args.batch,), device=dev)


def step():
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    return loss


for _ in range(args.warmup):
    step()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(args.steps):
    loss = step()
torch.cuda.synchronize()
dt = time.perf_counter() - t0
print(f"RESULT steps={args.steps} seconds={dt:.4f} ms_per_step={dt * 1e3 / args.steps:.3f} "
      f"final_loss={loss.item():.4f}", flush=True)
