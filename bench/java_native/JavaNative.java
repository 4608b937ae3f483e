// The Java side of bench/java_native.py: the Java KCL 2.5.8's own Scheduler and a minimal
// ShardRecordProcessor in one JVM, no MultiLangDaemon and no child process, so that what is
// measured is the Java KCL's record path as a Java application runs it.
//
// The processor does what the kclpy side does: a CRC32 of every payload (it reads every byte,
// and the sum of the CRCs lets the bench check that both sides saw the same bytes), and a
// checkpoint after every batch. The JVM measures itself (process CPU of every thread, JIT and
// GC included, and VmHWM) at three moments: the first record, half of the records, the last;
// it prints one JSON line and halts, so that shutting the Scheduler down is never measured.
//
// Arguments: KINESIS_URL DYNAMODB_URL STREAM APPLICATION EXPECTED_RECORDS MAX_RECORDS
// IDLE_MILLIS TIMEOUT_SECONDS

import com.sun.management.OperatingSystemMXBean;
import java.io.IOException;
import java.lang.management.ManagementFactory;
import java.net.URI;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.zip.CRC32;
import software.amazon.awssdk.auth.credentials.DefaultCredentialsProvider;
import software.amazon.awssdk.http.Protocol;
import software.amazon.awssdk.http.nio.netty.NettyNioAsyncHttpClient;
import software.amazon.awssdk.regions.Region;
import software.amazon.awssdk.services.cloudwatch.CloudWatchAsyncClient;
import software.amazon.awssdk.services.dynamodb.DynamoDbAsyncClient;
import software.amazon.awssdk.services.kinesis.KinesisAsyncClient;
import software.amazon.kinesis.common.ConfigsBuilder;
import software.amazon.kinesis.common.InitialPositionInStream;
import software.amazon.kinesis.common.InitialPositionInStreamExtended;
import software.amazon.kinesis.coordinator.Scheduler;
import software.amazon.kinesis.exceptions.KinesisClientLibException;
import software.amazon.kinesis.lifecycle.events.InitializationInput;
import software.amazon.kinesis.lifecycle.events.LeaseLostInput;
import software.amazon.kinesis.lifecycle.events.ProcessRecordsInput;
import software.amazon.kinesis.lifecycle.events.ShardEndedInput;
import software.amazon.kinesis.lifecycle.events.ShutdownRequestedInput;
import software.amazon.kinesis.metrics.NullMetricsFactory;
import software.amazon.kinesis.processor.ShardRecordProcessor;
import software.amazon.kinesis.processor.SingleStreamTracker;
import software.amazon.kinesis.retrieval.KinesisClientRecord;
import software.amazon.kinesis.retrieval.polling.PollingConfig;

public final class JavaNative {
    private static final OperatingSystemMXBean OS =
            (OperatingSystemMXBean) ManagementFactory.getOperatingSystemMXBean();

    /** Counts what the processors saw, and notes CPU and time at the three moments. */
    static final class Tally {
        private final long expect;
        private final CountDownLatch done = new CountDownLatch(1);
        private long records;
        private long bytes;
        private long checksum;
        private long halfRecords;
        private double cpuFirst;
        private double cpuHalf;
        private double cpuEnd;
        private double firstAt;
        private double halfAt;
        private double endAt;

        Tally(long expect) {
            this.expect = expect;
        }

        synchronized void add(long count, long size, long crcs) {
            if (count == 0) {
                return;
            }
            double cpu = OS.getProcessCpuTime() / 1e9;
            double now = System.currentTimeMillis() / 1e3;
            if (records == 0) {
                cpuFirst = cpu;
                firstAt = now;
            }
            records += count;
            bytes += size;
            checksum += crcs;
            if (halfRecords == 0 && records * 2 >= expect) {
                halfRecords = records;
                cpuHalf = cpu;
                halfAt = now;
            }
            if (records >= expect && done.getCount() > 0) {
                cpuEnd = cpu;
                endAt = now;
                done.countDown();
            }
        }

        synchronized long count() {
            return records;
        }

        synchronized String json() throws IOException {
            return String.format(
                    "{\"records\": %d, \"bytes\": %d, \"checksum\": %d, \"half_records\": %d, "
                            + "\"cpu_first_s\": %.6f, \"cpu_half_s\": %.6f, \"cpu_end_s\": %.6f, "
                            + "\"first_at\": %.3f, \"half_at\": %.3f, \"end_at\": %.3f, "
                            + "\"peak_rss_kb\": %d}",
                    records, bytes, checksum, halfRecords, cpuFirst, cpuHalf, cpuEnd, firstAt,
                    halfAt, endAt, peakRssKb());
        }
    }

    /** Every payload byte through CRC32, a checkpoint after every batch. */
    static final class Processor implements ShardRecordProcessor {
        private final Tally tally;
        private final CRC32 crc = new CRC32();

        Processor(Tally tally) {
            this.tally = tally;
        }

        @Override
        public void initialize(InitializationInput input) {
        }

        @Override
        public void processRecords(ProcessRecordsInput input) {
            long size = 0;
            long crcs = 0;
            for (KinesisClientRecord record : input.records()) {
                ByteBuffer data = record.data().duplicate();
                size += data.remaining();
                crc.reset();
                crc.update(data);
                crcs += crc.getValue();
            }
            checkpoint(() -> input.checkpointer().checkpoint());
            tally.add(input.records().size(), size, crcs);
        }

        @Override
        public void leaseLost(LeaseLostInput input) {
        }

        @Override
        public void shardEnded(ShardEndedInput input) {
            checkpoint(() -> input.checkpointer().checkpoint());
        }

        @Override
        public void shutdownRequested(ShutdownRequestedInput input) {
        }
    }

    interface Checkpoint {
        void run() throws KinesisClientLibException;
    }

    /** A checkpoint that fails ends the run: the KCL would only log it and go on. */
    static void checkpoint(Checkpoint call) {
        try {
            call.run();
        } catch (KinesisClientLibException e) {
            System.err.println("checkpoint failed: " + e);
            Runtime.getRuntime().halt(1);
        }
    }

    static long peakRssKb() throws IOException {
        for (String line : Files.readAllLines(Paths.get("/proc/self/status"),
                StandardCharsets.US_ASCII)) {
            if (line.startsWith("VmHWM:")) {
                return Long.parseLong(line.replaceAll("[^0-9]", ""));
            }
        }
        return 0;
    }

    static NettyNioAsyncHttpClient.Builder http() {
        return NettyNioAsyncHttpClient.builder().protocol(Protocol.HTTP1_1);
    }

    public static void main(String[] args) throws Exception {
        URI kinesisUrl = URI.create(args[0]);
        URI dynamodbUrl = URI.create(args[1]);
        String stream = args[2];
        String application = args[3];
        Tally tally = new Tally(Long.parseLong(args[4]));
        int maxRecords = Integer.parseInt(args[5]);
        long idleMillis = Long.parseLong(args[6]);
        long timeoutSeconds = Long.parseLong(args[7]);
        Region region = Region.US_EAST_1;
        DefaultCredentialsProvider credentials = DefaultCredentialsProvider.create();
        // HTTP/1.1 clients: the SDK's Kinesis client defaults to HTTP/2 (for enhanced fan-out),
        // which a cleartext endpoint cannot negotiate; polling does not need it.
        KinesisAsyncClient kinesis = KinesisAsyncClient.builder().region(region)
                .credentialsProvider(credentials).endpointOverride(kinesisUrl)
                .httpClientBuilder(http()).build();
        DynamoDbAsyncClient dynamodb = DynamoDbAsyncClient.builder().region(region)
                .credentialsProvider(credentials).endpointOverride(dynamodbUrl)
                .httpClientBuilder(http()).build();
        // Required by ConfigsBuilder, never called: metrics go to the NullMetricsFactory.
        CloudWatchAsyncClient cloudwatch = CloudWatchAsyncClient.builder().region(region)
                .credentialsProvider(credentials).endpointOverride(URI.create("http://127.0.0.1:9"))
                .httpClientBuilder(http()).build();
        ConfigsBuilder configs = new ConfigsBuilder(
                new SingleStreamTracker(stream, InitialPositionInStreamExtended.newInitialPosition(
                        InitialPositionInStream.TRIM_HORIZON)),
                application, kinesis, dynamodb, cloudwatch, application + "-worker",
                () -> new Processor(tally));
        Scheduler scheduler = new Scheduler(
                configs.checkpointConfig(),
                configs.coordinatorConfig(),
                configs.leaseManagementConfig(),
                configs.lifecycleConfig(),
                configs.metricsConfig().metricsFactory(new NullMetricsFactory()),
                configs.processorConfig(),
                configs.retrievalConfig().retrievalSpecificConfig(
                        new PollingConfig(stream, kinesis).maxRecords(maxRecords)
                                .idleTimeBetweenReadsInMillis(idleMillis)));
        Thread runner = new Thread(scheduler, "bench-scheduler");
        runner.setDaemon(true);
        runner.start();
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(timeoutSeconds);
        // The Scheduler gives up on its own (initialisation failed 20 times): that ends the
        // run at once instead of at the timeout.
        while (!tally.done.await(1, TimeUnit.SECONDS)) {
            if (!runner.isAlive() || System.nanoTime() > deadline) {
                System.err.println("saw " + tally.count() + " of " + tally.expect + " records; "
                        + (runner.isAlive() ? "timed out" : "the Scheduler ended"));
                Runtime.getRuntime().halt(1);
            }
        }
        System.out.println(tally.json());
        System.out.flush();
        Runtime.getRuntime().halt(0);
    }
}
