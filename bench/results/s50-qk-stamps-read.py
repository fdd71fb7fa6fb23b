# Reads the stamp files of bench/results/s50-qk-stamps.patch (M3RT_QK_STAMPS=path m3rt bench --filter qknorm): per-warp entry,
# first / last token landed, loop end; usage: python3 s50-qk-stamps-read.py FILE...
import struct, sys, numpy as np
def load(f):
    b=open(f,'rb').read()
    gx,gy,T,_=struct.unpack('4i',b[:16])
    a=np.frombuffer(b[16:],dtype=np.uint64).reshape(-1,8).astype(np.int64)
    a=a[:gx*gy*4]
    return gx,gy,T,a
for f in sys.argv[1:]:
    gx,gy,T,a=load(f)
    live=a[a[:,4]>0]
    t0=live[:,0].min(); r=lambda x:(x-t0)/1000.0
    st=r(live[:,0]); fi=r(live[:,1]); la=r(live[:,2]); en=r(live[:,3]); n=live[:,4]
    print('%s: grid %dx%d, %d warps with tokens (%d-%d tokens each)'%(f,gx,gy,len(live),n.min(),n.max()))
    q=lambda x:'%.2f / %.2f / %.2f / %.2f'%(x.min(),np.percentile(x,10),np.median(x),x.max())
    print('   entry        min/p10/med/max', q(st))
    print('   first landed                ', q(fi))
    print('   last landed                 ', q(la))
    print('   loop end                    ', q(en))
    for k in sorted(set(n)):
        m=n==k; print('     warps with %d tokens: %d, loop end median %.2f max %.2f'%(k,m.sum(),np.median(en[m]),en[m].max()))
    # time when 50%/90%/99% of warps done
    print('   warps done at 50/90/99/100%%: %.2f %.2f %.2f %.2f'%tuple(np.percentile(en,[50,90,99,100])))
