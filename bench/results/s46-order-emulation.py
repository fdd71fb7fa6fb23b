# Session 46: the token tile's union order, main's O(U^2) count against tt-prologue2's occupancy-bit places, on 20,000 random unions (python3 this file: "ok 20000").
import random
def orders(U_masks):
    U=len(U_masks)
    # main: key (rank*32+w)*1024+e, masks 0: (1<<30)+e
    keyM=[None]*U; keyT=[None]*U; occ=[0]*16
    for w in range(8):
        run=0
        for e in range(U):
            m=U_masks[e]
            if (m>>w)&1:
                rank=run; run+=1
            else: rank=None
            if m and (m & -m).bit_length()-1==w:
                keyM[e]=(rank*32+w)*1024+e
                k=rank*8+w; keyT[e]=k; occ[k//32]|=1<<(k%32)
        # note: tokens >= gr.tokens not looping; emulate all 8
    for e in range(U):
        if U_masks[e]==0: keyM[e]=(1<<30)+e; keyT[e]=-1
    posM=[sum(1 for j in range(U) if keyM[j]<keyM[e]) for e in range(U)]
    posT=[]
    for e in range(U):
        k=keyT[e]
        if k>=0:
            p=sum(bin(occ[i]).count('1') for i in range(k//32))+bin(occ[k//32]&((1<<(k%32))-1)).count('1')
        else:
            p=sum(bin(x).count('1') for x in occ)+sum(1 for j in range(e) if keyT[j]<0)
        posT.append(p)
    return posM,posT
random.seed(1)
for it in range(20000):
    topk=random.choice([1,2,4,8,16,32,64]); ntok=random.randint(1,8); nb=random.randint(1,600)
    sel={}
    for r in range(ntok):
        ids=random.sample(range(nb),min(topk,nb))
        for i in ids: sel[i]=sel.get(i,0)|(1<<r)
    ids=sorted(sel)
    masks=[sel[i] if random.random()>0.05 else 0 for i in ids]  # some pages no token sees
    # union masks are subsets of selectors: emulate by random dropping of bits
    masks=[m & random.choice([m, m, m, m & (m-1)]) for m in masks]
    pm,pt=orders(masks)
    assert pm==pt,(it,masks)
    assert sorted(pt)==list(range(len(masks)))
print("ok 20000")
