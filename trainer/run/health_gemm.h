/* health_gemm: `trainer --health-gemm`, the GEMM of meshrun's --health_check (launcher/health.c
 * runs it as a child; an internal mode, not in --help).
 *
 * It measures the devices this node's workers will compute on: the device backend that device
 * "auto" would pick (the first of the registry that is built and sees a device), on
 * min(LOCAL_WORLD_SIZE, visible) devices, numbered as the workers' local ranks take them; where
 * no device backend sees one, the host backend, as one "device". On each, one matrix product
 * c = a b of side HEALTH_GEMM_DEVICE_N (HEALTH_GEMM_HOST_N on the host) through the backend
 * table's matmul, in the dtype the device trains in by default (param_dtype's default,
 * device_default_dtype: bf16 on a device, fp32 on the host): a first product (the library's
 * choice of kernel, the clocks' ramp) untimed, then HEALTH_GEMM_SLICES slices of at least
 * HEALTH_GEMM_SLICE_S each, a slice being batches of products with a synchronize after each
 * batch; a device's rate is its best slice's, so that a moment of contention does not make a
 * slow device. Each device is measured in a child process of its own, all at once, as the
 * workers will load them (this process opens no device, so that it may fork; the children die
 * with it).
 *
 * One line of JSON on stdout, nothing else there:
 *   {"gflops": 812345.6, "devices": [812345.6, ...], "device": "cuda", "dtype": "bf16", "n": 4096}
 * gflops is the slowest device's rate (one bad GPU makes a bad node), GFLOP/s. Errors (no
 * backend opens, a device's backend fails to open) are one line on stderr and exit status 1;
 * a device error inside a product takes the backend's fatal path (also exit 1).
 *
 * The slices and the throttle are meshrun's host loop's (common/gemm_rate.h, one measure for
 * both): MESHRUN_FAULT_HEALTH_GEMM=F (0 < F < 1) throttles it to about F of its speed, a pause
 * of (1/F - 1) times each batch's time after it. */
#ifndef MESHRUN_HEALTH_GEMM_H
#define MESHRUN_HEALTH_GEMM_H

#define HEALTH_GEMM_DEVICE_N 4096 /* 0.14 TFLOP a product: compute-bound on a GPU */
#define HEALTH_GEMM_DEVICE_BATCH 16
#define HEALTH_GEMM_HOST_N 256    /* 34 MFLOP a product: a few per slice on one core */
#define HEALTH_GEMM_HOST_BATCH 1
#define HEALTH_GEMM_SLICES 4
#define HEALTH_GEMM_SLICE_S 0.03

/* The whole mode: measures, prints the line (or the error), returns the exit status (0 or 1). */
int health_gemm_main(void);

#endif
