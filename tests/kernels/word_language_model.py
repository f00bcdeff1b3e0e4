"""An LSTM language model with tied weights: the pytorch/examples word_language_model/main.py loop, condensed.

Kept as written there: `--cuda`, `device = torch.device("cuda" if args.cuda else "cpu")`,
batchify(...).to(device), `--tied` (`self.decoder.weight = self.encoder.weight`, which
model.to(xla) unties), `model = RNNModel(...).to(device)`, the hand-written SGD update
`p.data.add_(p.grad, alpha=-lr)` after clip_grad_norm_, repackage_hidden, get_batch over bptt,
and `total_loss += loss.item()` each step. The corpus is tokens from a generated Markov chain
instead of Wikitext-2 (data.Corpus), the model one small layer.
"""
import argparse
import json

import torch
import torch.nn as nn

parser = argparse.ArgumentParser(description='PyTorch Wikitext-2 RNN/LSTM Language Model')
parser.add_argument('--emsize', type=int, default=32)
parser.add_argument('--nhid', type=int, default=32)
parser.add_argument('--lr', type=float, default=20)
parser.add_argument('--clip', type=float, default=0.25)
parser.add_argument('--epochs', type=int, default=40)
parser.add_argument('--batch_size', type=int, default=20, metavar='N')
parser.add_argument('--bptt', type=int, default=16)
parser.add_argument('--dropout', type=float, default=0.2)
parser.add_argument('--tied', action='store_true', help='tie the word embedding and softmax weights')
parser.add_argument('--seed', type=int, default=1111)
parser.add_argument('--cuda', action='store_true', default=False, help='use CUDA')
parser.add_argument('--log-interval', type=int, default=200, metavar='N')
parser.add_argument('--dry-run', action='store_true', help='verify the code and the model')
args = parser.parse_args()

torch.manual_seed(args.seed)
if torch.cuda.is_available():
    if not args.cuda:
        print("WARNING: You have a CUDA device, so you should probably run with --cuda.")

device = torch.device("cuda" if args.cuda else "cpu")

ntokens = 32
g = torch.Generator().manual_seed(0)
successors = torch.randint(0, ntokens, (ntokens, 2), generator=g)
tokens = [0]
for k in range(8000):
    tokens.append(int(successors[tokens[-1], int(torch.rand(1, generator=g) < 0.2)]))
corpus_train = torch.tensor(tokens)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    data = data.view(bsz, -1).t().contiguous()
    return data.to(device)


train_data = batchify(corpus_train, args.batch_size)


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, dropout=0.5, tie_weights=False):
        super(RNNModel, self).__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, 1)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            if nhid != ninp:
                raise ValueError('When using the tied flag, nhid must be equal to emsize')
            self.decoder.weight = self.encoder.weight
        self.init_weights()
        self.nhid = nhid

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.decoder.out_features)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(1, bsz, self.nhid), weight.new_zeros(1, bsz, self.nhid))


model = RNNModel(ntokens, args.emsize, args.nhid, args.dropout, args.tied).to(device)
criterion = nn.NLLLoss()


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


losses = []


def train():
    model.train()
    total_loss = 0.
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1 - args.bptt, args.bptt)):
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        total_loss += loss.item()
        losses.append(loss.item())
        if batch % args.log_interval == 0 and batch > 0:
            print('| epoch {:3d} | {:5d} batches | loss {:5.2f}'.format(epoch, batch, total_loss / args.log_interval))
            total_loss = 0
        if args.dry_run and batch == 2:
            break


lr = args.lr
for epoch in range(1, args.epochs + 1):
    train()
    if args.dry_run:
        break
print("RESULT " + json.dumps({"first_loss": losses[0], "last_loss": losses[-1],
                              "tied": model.decoder.weight is model.encoder.weight,
                              "parameters": len(list(model.parameters()))}))
